"""The committed record of a sweep: record.json (everything raw), summary.md (the table, the
targets, the breakdown) and two SVG plots with the floor drawn in, written to a temporary folder
and swapped in whole (iquestrt/files.py), so a reader never sees half a record."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from benchmarks.rank.floor import kv_growth_bytes
from benchmarks.rank.shapes import rank_config
from iquestrt import outputs
from iquestrt.report.provenance import code_identity
from iquestrt.report.svg import line_chart

OUTPUT = outputs.OutputSpec("--out", "record.json")

TARGET_RATIO, TARGET_GROWTH, TARGET_SPEEDUP = 1.5, 1.2, 5.0


def environment() -> dict:
    rev = code_identity()  # dirty: `git status --porcelain` lines, status kept (" M p" → "M p")
    env = {"revision": rev["commit"], "dirty_files": rev["dirty"],
           "source_digest": rev["source_digest"], "claimed_revision": rev["claimed_revision"],
           "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _find(rows: list[dict], ctx_name: str, policy: str) -> dict | None:
    for r in rows:
        if r.get("context_name") == ctx_name and r.get("policy") == policy and "error" not in r:
            return r
    return None


def summarize(rec: dict) -> dict:
    """The TARGET_* targets from a record (None where the sweep did not cover a target)."""
    rows, bw = rec["configs"], rec["bandwidth"]
    head = f"W{rec['spec']['headline_width']}"
    out: dict = {"headline": None, "growth": None, "speedup": None}
    h1 = _find(rows, "1K", head)
    if h1:
        out["headline"] = {"round_s": h1["round_s"], "floor_s": h1["floor_s"],
                           "ratio": h1["ratio"], "ok": h1["ratio"] <= TARGET_RATIO}
    h192 = _find(rows, "192K", head)
    if h1 and h192:
        extra = kv_growth_bytes(rank_config(), h1["shape"]["rows"], h1["context"],
                                h192["context"]) / bw
        grow = h192["round_s"] - h1["round_s"]
        out["growth"] = {"round_growth_s": grow, "kv_floor_s": extra,
                         "ratio": grow / extra, "ok": grow <= TARGET_GROWTH * extra}
    base = rec.get("baseline") or {}
    first = min((r for r in rows if "error" not in r and r["policy"] == head),
                key=lambda r: r["context"], default=None)
    if first and base.get("variants"):
        sp = {}
        for name, v in base["variants"].items():
            if "scaled_round_s" in v:
                sp[name] = v["scaled_round_s"] / first["round_s"]
        comp = sp.get("compile-gather")
        out["speedup"] = {"vs": sp, "context": first["context_name"],
                          "ok": None if comp is None else comp >= TARGET_SPEEDUP}
    return out


def _ms(x) -> str:
    return "—" if x is None else f"{x * 1e3:.3f}"


def markdown(rec: dict) -> str:
    env, spec, s = rec["env"], rec["spec"], summarize(rec)
    lines = [f"# Per-rank IQuest-Q1 round benchmark — {env.get('gpu', 'no GPU')}", "",
             f"Revision `{env['revision']}`" + (f" (+{len(env['dirty_files'])} uncommitted files)"
                                               if env["dirty_files"] else "")
             + (f" (runner's commit `{env['claimed_revision']}`)"
                if env.get("claimed_revision") else "")
             + (f", source digest `{env['source_digest'][:16]}`"
                if env.get("source_digest") else "")
             + f", torch {env['torch']}, Triton {env['triton']}. Command: `{rec['command']}`. "
             f"Copy bandwidth measured in this run: {rec['bandwidth'] / 1e12:.3f} TB/s. "
             + (f"Control launches {'with' if rec['rig']['pdl'] else 'without'} programmatic "
                f"dependent launch (--pdl {spec['pdl']}). " if "pdl" in rec.get("rig", {}) else "")
             + f"Wall time {rec['wall_s']:.0f} s; peak allocated "
             f"{rec['peak_allocated_bytes'] / 1e9:.1f} GB.", "", "## Targets", ""]
    h, g, sp = s["headline"], s["growth"], s["speedup"]
    lines.append(f"- round ÷ floor at 1K, width {spec['headline_width']}: "
                 + (f"**{h['ratio']:.2f}×** ({_ms(h['round_s'])} ms vs {_ms(h['floor_s'])} ms; "
                    f"target ≤ {TARGET_RATIO}: {'met' if h['ok'] else 'not met'})" if h
                    else "not measured"))
    lines.append("- growth 1K → 192K: " + (
        f"{_ms(g['round_growth_s'])} ms vs {_ms(g['kv_floor_s'])} ms of extra KV at the copy "
        f"bandwidth (**{g['ratio']:.2f}×**; target ≤ {TARGET_GROWTH}: "
        f"{'met' if g['ok'] else 'not met'})" if g else "not measured"))
    lines.append("- vs the BF16 torch baseline: " + (
        ", ".join(f"{k} {v:.1f}× slower" for k, v in sp["vs"].items())
        + f" (at {sp['context']}; target ≥ {TARGET_SPEEDUP}× vs compiled: "
        + ("not measured" if sp["ok"] is None else "met" if sp["ok"] else "not met") + ")"
        if sp else "not measured"))
    lines += ["", "## Rounds", "",
              "| context | policy | round ms | floor ms | ÷ floor | loop ms/round | rows | "
              "depth | distinct experts | floor GB | launches |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rec["configs"]:
        if "error" in r:
            lines.append(f"| {r['context_name']} | {r['policy']} | error: {r['error'][:80]} |"
                         " | | | | | | | |")
            continue
        sh = r["shape"]
        lines.append(f"| {r['context_name']} | {r['policy']} | {_ms(r['round_s'])} | "
                     f"{_ms(r['floor_s'])} | {r['ratio']:.2f} | {_ms(r['loop_round_s'])} | "
                     f"{sh['rows']:.2f} | {sh['depth']:.2f} | {sh['distinct']:.1f} | "
                     f"{r['floor_bytes'] / 1e9:.2f} | "
                     f"{r['breakdown']['launches'] if 'breakdown' in r else '—'} |")
    e = rec.get("eager")
    if e and "round_s" in e:
        lines += ["", f"Eager launches (no CUDA graph) at the first context, width "
                      f"{spec['headline_width']}: {_ms(e['round_s'])} ms/round."]
    lines += (_tp_md(rec) + _variants_md(rec) + _breakdown_md(rec) + _routing_md(rec)
              + _baseline_md(rec))
    lines += ["", "Round time: median interval between consecutive rounds of a request "
              "(CUDA events, graph replay, host loop); loop ms/round: the engine's loop phase "
              "over the request (log reads and final settlement included) ÷ rounds. Floor: "
              "benchmarks/rank/floor.py terms in record.json.", ""]
    return "\n".join(lines)


def _tp_md(rec: dict) -> list[str]:
    tp = rec.get("tp")
    if not tp:
        return []
    n = tp["world"]
    out = ["", f"## Tensor parallelism: {n} processes ({tp['backend']}), real ring", "",
           f"Every process is a TP8 rank; the target's O and expert reductions go through the "
           f"peer-memory ring over the {n} GPUs plus {tp['emulated']} emulated ranks (ring slots: "
           f"O {tp['ring_slots']['o']}, MoE {tp['ring_slots']['moe']}). Not exchanged: "
           + "; ".join(tp["not_exchanged"]) + ".", "",
           "| context | policy | " + " | ".join(f"rank {q} ms" for q in range(n))
           + " | slowest ÷ rank 0 |", "| --- | --- | " + " | ".join("---" for _ in range(n + 1))
           + " |"]
    for i, r in enumerate(rec["configs"]):
        times = [row[i] for row in tp["rank_round_s"]]
        if "error" in r or any(t != t for t in times):  # NaN: failed on some rank
            continue
        out.append(f"| {r['context_name']} | {r['policy']} | "
                   + " | ".join(_ms(t) for t in times) + f" | {max(times) / times[0]:.3f} |")
    return out


def variant_pairs(rec: dict) -> list[dict]:
    """Rows "<policy>+<variant>" (--pdl ab: "+pdl"; --launch: "+<overrides>") against
    "<policy>" at the same context."""
    out = []
    for r in rec["configs"]:
        base_name, plus, variant = r["policy"].partition("+")
        if not plus or "error" in r:
            continue
        base = _find(rec["configs"], r["context_name"], base_name)
        if base and "error" not in base:
            out.append({"context_name": r["context_name"], "policy": base_name,
                        "variant": variant, "control_s": base["round_s"],
                        "variant_s": r["round_s"], "ratio": r["round_s"] / base["round_s"],
                        "launches": tuple(x["breakdown"]["launches"] if "breakdown" in x
                                          else None for x in (base, r))})
    return out


def _variants_md(rec: dict) -> list[str]:
    pairs = variant_pairs(rec)
    if not pairs:
        return []
    lines = ["", "## Variants (A/B in this run, alternating)", "",
             "| context | policy | variant | round ms, control | round ms, variant | "
             "variant ÷ control | launches, control → variant |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in pairs:
        a, b = p["launches"]
        launches = "—" if a is None or b is None else f"{a} → {b}"
        lines.append(f"| {p['context_name']} | {p['policy']} | {p['variant']} | "
                     f"{_ms(p['control_s'])} | {_ms(p['variant_s'])} | {p['ratio']:.3f} | "
                     f"{launches} |")
    return lines


def _breakdown_md(rec: dict) -> list[str]:
    rows = [r for r in rec["configs"] if "breakdown" in r]
    if not rows:
        return []
    fams = sorted({f for r in rows for f in r["breakdown"]["by_family"]})
    out = ["", "## Per-kernel breakdown (one eager round, CUDA time by family, µs)", "",
           "| context | policy | launches | Σ kernels µs | round µs | " + " | ".join(fams) + " |",
           "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in fams) + " |"]
    for r in rows:
        b = r["breakdown"]
        cells = [f"{b['by_family'][f][1] * 1e6:.0f}" if f in b["by_family"] else "" for f in fams]
        out.append(f"| {r['context_name']} | {r['policy']} | {b['launches']} | "
                   f"{b['kernel_s'] * 1e6:.0f} | {r['round_s'] * 1e6:.0f} | " + " | ".join(cells)
                   + " |")
    return out


def _routing_md(rec: dict) -> list[str]:
    d = rec["routing"]["distinct"]
    ws = sorted({w for v in d.values() for w in v}, key=int)
    out = ["", f"## Distinct experts per layer (routing: {rec['spec']['routing']}, mapping "
               f"{rec['routing']['mapping']}; seed report: 37.7 at 6 rows on real requests)", "",
           "| source | " + " | ".join(f"{w} rows" for w in ws) + " |",
           "| --- | " + " | ".join("---" for _ in ws) + " |"]
    for name, v in d.items():
        out.append(f"| {name} | " + " | ".join(f"{v[w]:.1f}" if w in v else "" for w in ws)
                   + " |")
    return out


def _baseline_md(rec: dict) -> list[str]:
    b = rec.get("baseline") or {}
    if not b.get("variants"):
        return []
    out = ["", f"## BF16 torch baseline (context {b['context']}, depth {b['depth']}; layers "
               f"{len(b['subset_layers'])} timed, scaled to {b['scaled_to']})", ""]
    for name, v in b["variants"].items():
        if "error" in v:
            out.append(f"- {name}: did not run: {v['error'][:300]}")
        else:
            out.append(f"- {name}: {_ms(v['scaled_round_s'])} ms/round scaled")
    return out


def plots(rec: dict) -> dict[str, str]:
    rows = [r for r in rec["configs"] if "error" not in r]
    head = f"W{rec['spec']['headline_width']}"
    ctxs = sorted({r["context"] for r in rows})
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    out = {}
    if len(ctxs) >= 1:
        series = {}
        for p in pols:
            series[p] = [next((r["round_s"] * 1e3 for r in rows
                               if r["policy"] == p and r["context"] == c), float("nan"))
                         for c in ctxs]
        series[f"floor {head}"] = [next((r["floor_s"] * 1e3 for r in rows
                                         if r["policy"] == head and r["context"] == c),
                                        float("nan")) for c in ctxs]
        out["round_vs_context.svg"] = line_chart(
            "Round time vs context", [c / 1024 for c in ctxs], series, "context (K tokens)",
            "ms per round", dashed=frozenset({f"floor {head}"}))
    first = ctxs[0] if ctxs else None
    wrows = sorted((r for r in rows if r["context"] == first and r["policy"][1:].isdigit()),
                   key=lambda r: int(r["policy"][1:]))  # W<n> only, not the "+…" variants
    if wrows:
        out["round_vs_width.svg"] = line_chart(
            f"Round time vs width at context {wrows[0]['context_name']}",
            [int(r["policy"][1:]) for r in wrows],
            {"round": [r["round_s"] * 1e3 for r in wrows],
             "floor": [r["floor_s"] * 1e3 for r in wrows]},
            "verification rows (depth + 1)", "ms per round", dashed=frozenset({"floor"}))
    return out


def write_record(rec: dict, out_dir: Path) -> Path:
    """record.json, summary.md and the plots into out_dir, replaced whole (iquestrt/outputs.py:
    only an earlier record is replaced)."""
    rec = dict(rec)
    rec.setdefault("env", environment())
    with outputs.writing(outputs.check(Path(out_dir), OUTPUT, force=True)) as tmp:
        (tmp / "record.json").write_text(json.dumps(rec, indent=1, default=_json) + "\n")
        (tmp / "summary.md").write_text(markdown(rec))
        for name, svg in plots(rec).items():
            (tmp / name).write_text(svg)
    return Path(out_dir)


def _json(x):
    if isinstance(x, tuple):
        return list(x)
    raise TypeError(f"record: {type(x).__name__} is not JSON-serializable")
