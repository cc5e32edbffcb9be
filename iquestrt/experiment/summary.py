"""Experiment statistics (per arm, and paired comparisons with bootstrap intervals) and the
Markdown rendering of a record (iquestrt/experiment/record.py holds the JSON's other parts).

Per pair (prompt, seed) each arm has one run. Compared against the control, per other arm:
  tpot_ratio     Σ time per output token (arm) / Σ (control), paired bootstrap interval
  round_ratio    the same for round latency (decode time / rounds)
  accepted_diff  mean(accepted length (arm) − accepted length (control)), reported apart from
                 the timings: a depth policy changes acceptance and cost per round together
  identical_outputs  pairs whose tokens are equal in both arms
The control′ arm (A′) is a second control engine: its ratios should straddle 1; when they do
not, an offset of that size exists between two builds or run slots of the same settings.
"""

from __future__ import annotations

from statistics import fmean

from iquestrt.experiment.bootstrap import mean_difference, ratio_of_means


def _by_pair(runs, labels) -> list[dict]:
    pairs: dict[int, dict] = {}
    for r in runs:
        pairs.setdefault(r.pair, {})[r.arm] = r
    out = [pairs[i] for i in sorted(pairs)]
    for i, p in enumerate(out):
        if set(p) != set(labels):
            raise ValueError(f"summary: pair {i} has runs of {sorted(p)}, expected {labels}")
    return out


def summarize(runs, labels: list[str], *, resamples: int, seed: int, level: float) -> dict:
    pairs = _by_pair(runs, labels)
    per_arm = {}
    for a in labels:
        rs = [p[a] for p in pairs]
        per_arm[a] = {"runs": len(rs), "tokens": sum(r.tokens for r in rs),
                      "rounds": sum(r.rounds for r in rs),
                      "accepted_mean": fmean(r.accepted for r in rs),
                      "tpot_ms_mean": fmean(r.tpot_ms for r in rs),
                      "round_ms_mean": fmean(r.round_ms for r in rs)}
    ctrl = labels[0]
    kw = dict(resamples=resamples, seed=seed, level=level)
    comparisons = []
    for a in labels[1:]:
        c, x = [p[ctrl] for p in pairs], [p[a] for p in pairs]
        comparisons.append({
            "arm": a, "vs": ctrl, "pairs": len(pairs),
            "tpot_ratio": ratio_of_means([r.tpot_ms for r in c], [r.tpot_ms for r in x],
                                         **kw).as_dict(),
            "round_ratio": ratio_of_means([r.round_ms for r in c], [r.round_ms for r in x],
                                          **kw).as_dict(),
            "accepted_diff": mean_difference([r.accepted for r in c], [r.accepted for r in x],
                                             **kw).as_dict(),
            "identical_outputs": sum(p[a].output_sha256 == p[ctrl].output_sha256
                                     for p in pairs),
        })
    return {"per_arm": per_arm, "comparisons": comparisons}


def _ci(d: dict, fmt: str) -> str:
    return f"{d['estimate']:{fmt}} [{d['lo']:{fmt}}, {d['hi']:{fmt}}]"


def _runtime(r: dict) -> str:
    p = r["policy"]
    depth = f"fixed depth {p['depth']}" if p["kind"] == "fixed" else \
        f"adaptive depth {p['min_depth']}-{p['max_depth']}"
    on = {True: "on", False: "off"}
    return (f"{depth}, graphs {on[r['graphs']]}, prefetch {on[r['prefetch']]}, sync_rounds "
            f"{r['sync_rounds']}, max_width {r['max_width']}, "
            f"{'pdl on, ' if r.get('pdl') else ''}{r['ops']} on {r['device']}, "
            f"ring_pad {r['ring_pad']}, max_positions {r['max_positions']}")


def _worktree(rev: dict) -> str:
    state = rev.get("worktree", "dirty" if rev["dirty"] else "clean")
    if state == "dirty":
        return (f" plus uncommitted changes ({len(rev['dirty'])} entries of git status, listed "
                "in record.json)")
    return " (clean checkout)" if state == "clean" else " (not run from a git checkout)"


def _load(v: float | None) -> str:
    return "not measured" if v is None else f"{v:.2f}"


def _straddles(d: dict) -> str:
    return "contains 1" if d["lo"] <= 1.0 <= d["hi"] else "EXCLUDES 1"


def markdown(rec: dict) -> str:
    plan, s = rec["plan"], rec["summary"]
    rev, env = rec["revision"], rec["environment"]
    level = s["comparisons"][0]["tpot_ratio"]["level"]
    lines = [f"# Experiment {rec['name']}", "", "## Warnings", ""]
    lines += [f"- **{w}**" for w in rec["warnings"]] or ["- none"]
    ld = rec["load"]
    lines += ["", f"Machine load (1-minute average): {_load(ld['load_1m_start'])} at start, "
              f"{_load(ld['load_1m_end'])} at end, on {ld['cpus']} CPUs (the experiment's own "
              f"{ld['own_threads']} thread(s) are part of the end value).", "", "## Setup", "",
             f"- revision: `{rev['commit']}`" + _worktree(rev),
             f"- command: `{rec['command']}`",
             f"- environment: {', '.join(f'{k} {v}' for k, v in env.items())}",
             f"- checkpoint `{plan['checkpoint']}`, {len(plan['prompts'])} prompts x seeds "
             f"{plan['seeds']}, {plan['max_new_tokens']} new tokens, sampling "
             f"{plan['sampling']}",
             f"- created {rec['created_utc']}", "", "## Arms", "",
             "| arm | spec | runtime |", "| --- | --- | --- |"]
    for a in plan["arms"]:
        lines.append(f"| {a['label']} | `{a['spec']}` | {_runtime(a['runtime'])} |")
    lines += ["", "## Results", "",
              "| arm | tokens | rounds | mean accepted length | ms/token (mean) | "
              "ms/round (mean) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for a, m in s["per_arm"].items():
        lines.append(f"| {a} | {m['tokens']} | {m['rounds']} | {m['accepted_mean']:.3f} | "
                     f"{m['tpot_ms_mean']:.3f} | {m['round_ms_mean']:.3f} |")
    lines += ["", f"Paired ratios (arm / control, ratio of means, bootstrap {level:.0%} "
              f"percentile interval over (prompt, seed) pairs):", "",
              "| arm | pairs | time per output token | round latency | "
              "accepted length difference | identical outputs |",
              "| --- | ---: | --- | --- | --- | ---: |"]
    for c in s["comparisons"]:
        lines.append(f"| {c['arm']} | {c['pairs']} | {_ci(c['tpot_ratio'], '.4f')} | "
                     f"{_ci(c['round_ratio'], '.4f')} | {_ci(c['accepted_diff'], '+.4f')} | "
                     f"{c['identical_outputs']}/{c['pairs']} |")
    for c in s["comparisons"]:
        if c["arm"] != plan["arms"][1]["label"]:
            lines += ["", f"A/A′ ({c['arm']}): the time-per-token interval "
                      f"{_straddles(c['tpot_ratio'])}, the round-latency interval "
                      f"{_straddles(c['round_ratio'])}."]
    lines += ["", "## Checks", ""]
    for name, v in rec["program_check"].items():
        lines.append(f"- {name}: captured graphs: {v['graphs']}; round programs: {v['programs']}")
    ok = all(c["tokens_equal"] and c["rounds_equal"] and c["caches_equal"]
             for c in rec["replay_checks"])
    lines.append(f"- replay from prefill snapshots vs real prefill: "
                 f"{'bit-exact' if ok else 'DIFFERS'} in {len(rec['replay_checks'])} checks "
                 f"({', '.join(sorted({c['arm'] for c in rec['replay_checks']}))})")
    lines += ["", "## Raw runs", "",
              "| pair | slot | arm | prompt | seed | tokens | rounds | accepted | decode s | "
              "ms/token | ms/round |",
              "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rec["runs"]:
        lines.append(f"| {r['pair']} | {r['slot']} | {r['arm']} | {r['prompt']} | {r['seed']} "
                     f"| {r['tokens']} | {r['rounds']} | {r['accepted']:.3f} | "
                     f"{r['decode_s']:.4f} | {r['tpot_ms']:.3f} | {r['round_ms']:.3f} |")
    lines += ["", "## Log", "", "```", *rec["log"], "```", ""]
    return "\n".join(lines)
