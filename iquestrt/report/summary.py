"""summary.md + summary.html (+ plots/*.svg) of an acceptance Dataset (iquestrt/report/dataset.py).
Everything here is computed from the Dataset alone, so a stored .nc can be summarized again."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from pathlib import Path

import numpy as np
import xarray as xr

from iquestrt.report.svg import bar_chart, line_chart


@dataclass(frozen=True)
class PolicyStats:
    policy: str
    requests: int
    rounds: int
    tokens: int
    mean_depth: float  # drafts per round
    tokens_per_round: float  # ratio of sums
    draft_acceptance: float  # accepted drafts / drafted
    tpot_ms: float  # ratio of sums over the requests with ≥ 2 rounds
    first_round_ms: float  # mean


def policies(ds: xr.Dataset) -> list[str]:
    return list(dict.fromkeys(str(p) for p in ds.policy.values))


def _sel(ds: xr.Dataset, mask) -> xr.Dataset:
    return ds.isel(request=np.flatnonzero(np.asarray(mask)))


def _ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b else float("nan")


def _tpot_ms(ds: xr.Dataset) -> float:
    tp = ds.time_per_output_token_s.values
    ok = np.isfinite(tp)
    first = ds.accepted_length.isel(round=0).values
    after = ds.new_tokens.values - first
    return 1e3 * _ratio((tp[ok] * after[ok]).sum(), after[ok].sum())


def policy_stats(ds: xr.Dataset, policy: str) -> PolicyStats:
    s = _sel(ds, ds.policy.values == policy)
    ch, ac = s.chosen_depth.values, s.accepted_drafts.values
    valid = ch >= 0
    return PolicyStats(
        policy, s.sizes["request"], int(valid.sum()), int(s.new_tokens.sum()),
        float(ch[valid].mean()) if valid.any() else float("nan"),
        _ratio(s.new_tokens.sum(), valid.sum()), _ratio(ac[valid].sum(), ch[valid].sum()),
        _tpot_ms(s), 1e3 * float(np.nanmean(s.first_round_s.values)))


def pooled_depth_acceptance(ds: xr.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Over all rounds of ds, per depth j: (rounds accepting ≥ j / rounds drafting ≥ j,
    rounds drafting ≥ j), each [depth]."""
    ch, ac = ds.chosen_depth.values, ds.accepted_drafts.values
    rate, n = [], []
    for j in ds.depth.values:
        drafted = ch >= j
        rate.append(_ratio(((ac >= j) & drafted).sum(), drafted.sum()))
        n.append(int(drafted.sum()))
    return np.array(rate), np.array(n)


def _fractions(values: np.ndarray, bins: list[int]) -> list[float]:
    v = values[values >= 0]
    return [_ratio((v == b).sum(), v.size) for b in bins]


def _paired(ds: xr.Dataset, a: str, b: str) -> tuple[int, float, str] | None:
    """Requests decoded under both policies (same prompt and seed): (pairs, mean difference of
    tokens per round a − b, "higher/equal/lower" counts of a)."""
    keys = list(zip(map(str, ds.request_id.values), map(int, ds.seed.values), strict=True))
    pol, tpr = ds.policy.values, ds.tokens_per_round.values
    of_b = {k: i for i, k in enumerate(keys) if pol[i] == b}
    diffs = [float(tpr[i] - tpr[of_b[k]]) for i, k in enumerate(keys) if pol[i] == a and k in of_b]
    if not diffs:
        return None
    signs = [sum(d > 0 for d in diffs), sum(d == 0 for d in diffs), sum(d < 0 for d in diffs)]
    return len(diffs), float(np.mean(diffs)), "/".join(map(str, signs))


def _f(x: float, digits: int = 2) -> str:
    return "–" if not np.isfinite(x) else f"{x:.{digits}f}"


def _runtime_desc(a) -> str:
    """' (ops kernels, graphs on)' for the runtime backend; '' for the reference or an older
    dataset without these attributes."""
    parts = [f"{k} {a[k]}" for k in ("ops", "graphs") if a.get(k)]
    return f" ({', '.join(parts)})" if parts else ""


def blocks(ds: xr.Dataset) -> list[tuple]:
    """The summary as blocks: ("h", text) | ("p", text) | ("table", header, rows) |
    ("fig", name, svg)."""
    pols = policies(ds)
    stats = [policy_stats(ds, p) for p in pols]
    kinds = list(dict.fromkeys(str(k) for k in ds.kind.values))
    depth = [int(j) for j in ds.depth.values]
    a = ds.attrs
    n_prompts, seeds = len(set(ds.request_id.values)), sorted(set(map(int, ds.seed.values)))
    out: list[tuple] = [
        ("h", "Acceptance report"),
        ("p", f"Checkpoint `{a.get('checkpoint')}` ({a.get('model')}), backend "
              f"{a.get('backend')}{_runtime_desc(a)}, prompts `{a.get('prompts')}`: "
              f"{ds.sizes['request']} decodes "
              f"({n_prompts} prompts × seeds {seeds} × policies {', '.join(pols)}), up to "
              f"{a.get('max_new_tokens')} new tokens, prompts cut to their last "
              f"{a.get('max_prompt_tokens')} tokens. Sampling: {a.get('sampling')}. "
              f"Policies: {a.get('policies')}."),
        ("p", f"Timing: {a.get('timing')}"),
        ("h", "Adaptive vs fixed depth"),
        ("table", ["policy", "decodes", "rounds", "tokens", "drafts/round", "tokens/round",
                   "draft acceptance", "ms/token after round 0", "ms to round 0"],
         [[s.policy, s.requests, s.rounds, s.tokens, _f(s.mean_depth), _f(s.tokens_per_round),
           _f(s.draft_acceptance, 3), _f(s.tpot_ms), _f(s.first_round_ms, 1)] for s in stats]),
    ]
    fixed = [p for p in pols if p != "adaptive"]
    if "adaptive" in pols and fixed:
        rows = []
        for f in fixed:
            pr = _paired(ds, "adaptive", f)
            if pr is not None:
                rows.append([f"adaptive − {f}", pr[0], _f(pr[1], 3), pr[2]])
        out.append(("table", ["comparison (same prompt, seed)", "pairs",
                              "mean Δ tokens/round", "adaptive higher/equal/lower"], rows))
    else:
        out.append(("p", "Only one kind of policy was run; pass `--depth adaptive 3` (or another "
                         "fixed depth) to compare adaptive and fixed depth."))
    dbins = list(range(0, depth[-1] + 1))
    out.append(("fig", "chosen_depth", bar_chart(
        "Chosen draft depth", [str(d) for d in dbins],
        {p: _fractions(_sel(ds, ds.policy.values == p).chosen_depth.values, dbins) for p in pols},
        "drafts in the round", "fraction of rounds")))
    lbins = list(range(1, depth[-1] + 2))
    out += [("h", "Accepted length"), ("fig", "accepted_length", bar_chart(
        "Accepted length per round", [str(b) for b in lbins],
        {p: _fractions(_sel(ds, ds.policy.values == p).accepted_length.values, lbins)
         for p in pols},
        "tokens emitted in the round", "fraction of rounds"))]
    acc = {p: pooled_depth_acceptance(_sel(ds, ds.policy.values == p)) for p in pols}
    out += [("h", "Per-depth acceptance"),
            ("p", "Rounds accepting at least j drafts over rounds that drafted at least j (in "
                  "brackets: rounds drafting at least j). An adaptive policy drafts past its "
                  "minimum depth only when it expects the drafts to survive, so its deeper "
                  "depths are a selected sample."),
            ("table", ["policy"] + [f"j={j}" for j in depth],
             [[p] + [f"{_f(x, 3)} ({n})" for x, n in zip(*acc[p], strict=True)] for p in pols]),
            ("fig", "depth_acceptance", line_chart(
                "Per-depth acceptance", depth, {p: list(acc[p][0]) for p in pols},
                "draft depth j",
                "P(accepted ≥ j | drafted ≥ j)"))]
    by_kind = {p: [_sel(ds, (ds.policy.values == p) & (ds.kind.values == k)) for k in kinds]
               for p in pols}
    tpr = {p: [_ratio(s.new_tokens.sum(), (s.chosen_depth.values >= 0).sum()) for s in v]
           for p, v in by_kind.items()}
    tpot = {p: [_tpot_ms(s) if s.sizes["request"] else np.nan for s in v]
            for p, v in by_kind.items()}
    out += [("h", "Tokens per round and time per output token"),
            ("fig", "tokens_per_round", bar_chart("Tokens per round", kinds, tpr, "prompt kind",
                                                  "new tokens / rounds")),
            ("fig", "time_per_token", bar_chart("Time per output token (after round 0)", kinds,
                                                tpot, "prompt kind", "ms / token"))]
    ex = ds.distinct_experts.mean("request", skipna=True)
    rows_x = [int(r) for r in ds.rows.values]
    e, k = int(a.get("n_experts", 0)), int(a.get("experts_per_token", 0))
    series = {f"layer {int(lay)}": list(ex.sel(layer=lay).values) for lay in ds.layer.values}
    series["min(E, r·K)"] = [float(min(e, r * k)) for r in rows_x]
    out += [("h", "Distinct experts per layer vs rows"),
            ("p", f"Mean number of distinct target experts (of E = {e}, top-{k}) used by r "
                  f"consecutive generated positions, over all decodes (dashed: min(E, r·K), no two "
                  f"rows sharing an expert). {a.get('routing', '')}"),
            ("table", ["layer"] + [f"r={r}" for r in rows_x],
             [[int(lay)] + [_f(x) for x in ex.sel(layer=lay).values] for lay in ds.layer.values]),
            ("fig", "distinct_experts", line_chart(
                "Distinct experts vs rows", rows_x, series, "rows r", "distinct experts",
                dashed=frozenset({"min(E, r·K)"})))]
    return out


def _md(blocks_: list[tuple]) -> str:
    lines = []
    for b in blocks_:
        if b[0] == "h":
            lines += [("# " if b[1] == "Acceptance report" else "## ") + b[1], ""]
        elif b[0] == "p":
            lines += [b[1], ""]
        elif b[0] == "table":
            lines += ["| " + " | ".join(map(str, b[1])) + " |",
                      "|" + "---|" * len(b[1])]
            lines += ["| " + " | ".join(map(str, r)) + " |" for r in b[2]] + [""]
        else:
            lines += [f"![{b[1]}](plots/{b[1]}.svg)", ""]
    return "\n".join(lines)


def _html(blocks_: list[tuple]) -> str:
    body = []
    for b in blocks_:
        if b[0] == "h":
            tag = "h1" if b[1] == "Acceptance report" else "h2"
            body.append(f"<{tag}>{escape(b[1])}</{tag}>")
        elif b[0] == "p":
            body.append(f"<p>{escape(b[1])}</p>")
        elif b[0] == "table":
            head = "".join(f"<th>{escape(str(c))}</th>" for c in b[1])
            rows = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in r) + "</tr>"
                           for r in b[2])
            body.append(f"<table><tr>{head}</tr>{rows}</table>")
        else:
            body.append(f"<figure>{b[2]}</figure>")
    style = ("body{font-family:sans-serif;max-width:900px;margin:2em auto}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;"
             "text-align:right}")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Acceptance report"
            f"</title><style>{style}</style></head><body>\n" + "\n".join(body) +
            "\n</body></html>\n")


def write_summary(ds: xr.Dataset, folder: Path) -> list[Path]:
    """Writes summary.md, summary.html (plots inline) and plots/<name>.svg into folder."""
    folder = Path(folder)
    (folder / "plots").mkdir(parents=True, exist_ok=True)
    bl = blocks(ds)
    written = []
    for b in bl:
        if b[0] == "fig":
            p = folder / "plots" / f"{b[1]}.svg"
            p.write_text(b[2], encoding="utf-8")
            written.append(p)
    for name, text in (("summary.md", _md(bl)), ("summary.html", _html(bl))):
        (folder / name).write_text(text, encoding="utf-8")
        written.append(folder / name)
    return written
