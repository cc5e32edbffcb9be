"""summary.md + summary.html (+ plots/*.svg) of an acceptance Dataset (iquestrt/report/dataset.py).
Everything here is computed from the Dataset alone, so a stored .nc can be summarized again,
also one whose integer grids hold −1 for missing entries without a declared _FillValue (the
committed reports/acceptance/ files): every count here keeps entries ≥ 0 only.

summary.html is summary.md rendered by the `markdown` library (tables extension), each plot's
image line replaced by the SVG itself, so the HTML file stands alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import markdown
import numpy as np
import xarray as xr

from iquestrt.report.stats import FEW_ROUNDS, LEVEL, wilson_interval
from iquestrt.report.svg import ErrorStyle, PointErrors, bar_chart, line_chart


@dataclass(frozen=True)
class SummaryConfig:
    few_rounds: int = FEW_ROUNDS  # per-depth points on fewer rounds are flagged
    level: float = LEVEL  # of the per-depth Wilson intervals


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


@dataclass(frozen=True)
class DepthRate:
    """Per-depth acceptance of one policy, pooled over all its rounds."""
    policy: str
    depth: int  # j
    accepted: int  # k: rounds accepting ≥ j drafts (among those drafting ≥ j)
    drafted: int  # n: rounds drafting ≥ j
    lo: float  # Wilson interval of k / n
    hi: float

    @property
    def rate(self) -> float:
        return _ratio(self.accepted, self.drafted)


def depth_rates(ds: xr.Dataset, policy: str, level: float = LEVEL) -> list[DepthRate]:
    """One DepthRate per depth j of ds over the rounds of `policy`."""
    s = _sel(ds, ds.policy.values == policy)
    ch, ac = s.chosen_depth.values, s.accepted_drafts.values
    out = []
    for j in map(int, ds.depth.values):
        drafted = ch >= j  # NaN (a missing round) compares false
        k, n = int(((ac >= j) & drafted).sum()), int(drafted.sum())
        out.append(DepthRate(policy, j, k, n, *wilson_interval(k, n, level)))
    return out


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


def _code(text) -> str:
    """Markdown code span of text, fenced by more backticks than any run inside it."""
    t = str(text)
    fence = "`" * (max((len(r) for r in re.findall("`+", t)), default=0) + 1)
    pad = " " if t.startswith("`") or t.endswith("`") else ""
    return f"{fence}{pad}{t}{pad}{fence}"


def _provenance(a) -> str:
    """Code revision, checkpoint hash and command; 'not recorded' for an older dataset."""
    rev = a.get("code_revision", "not recorded")
    tree = {"clean": "clean worktree", "dirty": "plus uncommitted changes (listed in the "
            "dataset's `code_worktree_changes`)"}.get(a.get("code_worktree"), "worktree unknown")
    ck = a.get("checkpoint_sha256")
    ck_text = (f"checkpoint sha256 {_code(ck)} (over its `*.safetensors` and `*.json` files; "
               "see the dataset's `checkpoint_sha256_covers`)" if ck else
               "checkpoint hash not recorded")
    cmd = a.get("command")
    return (f"Code revision {_code(rev)}, {tree}; {ck_text}. "
            + (f"Command: {_code(cmd)}." if cmd else "Command not recorded."))


def _depth_blocks(pols: list[str], depth: list[int], rates: dict[str, list[DepthRate]],
                  cfg: SummaryConfig) -> list[tuple]:
    def is_few(r: DepthRate) -> bool:
        return 0 < r.drafted < cfg.few_rounds

    few = [r for p in pols for r in rates[p] if is_few(r)]
    lvl = f"{cfg.level:.0%}"
    rows = [[r.policy, r.depth, r.drafted, r.accepted, _f(r.rate, 3),
             f"[{_f(r.lo, 3)}, {_f(r.hi, 3)}]", "yes" if is_few(r) else ""]
            for p in pols for r in rates[p] if r.drafted > 0]
    if few:
        listed = ", ".join(f"{r.policy} j={r.depth} ({r.drafted} rounds)" for r in few)
        note = (f"Resting on fewer than {cfg.few_rounds} rounds (hollow in the plot, "
                f"'yes' under 'few rounds'): {listed}. Read these as rough.")
    else:
        note = f"Every point rests on at least {cfg.few_rounds} rounds."
    err = {p: PointErrors(tuple(r.lo for r in rates[p]), tuple(r.hi for r in rates[p]),
                          tuple(r.drafted for r in rates[p])) for p in pols}
    style = ErrorStyle(interval=f"Wilson {lvl} interval", count="n",
                       min_n=cfg.few_rounds, hollow=f"n < {cfg.few_rounds} rounds")
    return [
        ("h", "Per-depth acceptance"),
        ("p", "Rounds accepting at least j drafts (k) over rounds that drafted at least j (n), "
              f"with Wilson {lvl} intervals; depths no round drafted are left out. The interval "
              "treats rounds as independent trials; rounds of one decode share a prompt, so "
              "the real uncertainty is somewhat larger. An adaptive policy drafts past its "
              "minimum depth only when it expects the drafts to survive, so its deeper depths "
              "are a selected sample."),
        ("table", ["policy", "j", "n (rounds drafting ≥ j)", "k (accepting ≥ j)",
                   "acceptance k/n", f"Wilson {lvl} interval",
                   f"few rounds (n < {cfg.few_rounds})"], rows),
        ("p", note),
        ("fig", "depth_acceptance", line_chart(
            "Per-depth acceptance", depth, {p: [r.rate for r in rates[p]] for p in pols},
            "draft depth j", "P(accepted ≥ j | drafted ≥ j)", errors=err, style=style)),
        ("p", f"Bars: Wilson {lvl} intervals; the rows under the axis give n per point; hollow "
              f"points rest on fewer than {cfg.few_rounds} rounds."),
    ]


def blocks(ds: xr.Dataset, cfg: SummaryConfig = SummaryConfig()) -> list[tuple]:
    """The summary as blocks: ("h", text) | ("p", text) | ("table", header, rows) |
    ("fig", name, svg); _html adds ("raw", html)."""
    pols = policies(ds)
    stats = [policy_stats(ds, p) for p in pols]
    kinds = list(dict.fromkeys(str(k) for k in ds.kind.values))
    depth = [int(j) for j in ds.depth.values]
    a = ds.attrs
    n_prompts, seeds = len(set(ds.request_id.values)), sorted(set(map(int, ds.seed.values)))
    out: list[tuple] = [
        ("h", "Acceptance report"),
        ("p", f"Checkpoint {_code(a.get('checkpoint'))} ({a.get('model')}), backend "
              f"{a.get('backend')}{_runtime_desc(a)}, prompts {_code(a.get('prompts'))}: "
              f"{ds.sizes['request']} decodes "
              f"({n_prompts} prompts × seeds {seeds} × policies {', '.join(pols)}), up to "
              f"{a.get('max_new_tokens')} new tokens, prompts cut to their last "
              f"{a.get('max_prompt_tokens')} tokens. Sampling: {a.get('sampling')}. "
              f"Policies: {a.get('policies')}."),
        ("p", _provenance(a)),
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
    out += _depth_blocks(pols, depth, {p: depth_rates(ds, p, cfg.level) for p in pols}, cfg)
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
        elif b[0] == "raw":
            lines += [b[1], ""]
        else:
            lines += [f"![{b[1]}](plots/{b[1]}.svg)", ""]
    return "\n".join(lines)


def _html(blocks_: list[tuple]) -> str:
    """summary.md's text rendered as HTML, every plot inline."""
    # a <figure> at the start of a block is raw HTML to Python-Markdown: passed through as is
    inline = [b if b[0] != "fig" else ("raw", f"<figure>\n{b[2].strip()}\n</figure>")
              for b in blocks_]
    body = markdown.markdown(_md(inline), extensions=["tables"], output_format="html")
    style = ("body{font-family:sans-serif;max-width:900px;margin:2em auto}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;"
             "text-align:right}code{font-size:90%}")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Acceptance report"
            f"</title><style>{style}</style></head><body>\n{body}\n</body></html>\n")


def write_summary(ds: xr.Dataset, folder: Path, cfg: SummaryConfig = SummaryConfig()
                  ) -> list[Path]:
    """Writes summary.md, summary.html (plots inline) and plots/<name>.svg into folder."""
    folder = Path(folder)
    (folder / "plots").mkdir(parents=True, exist_ok=True)
    bl = blocks(ds, cfg)
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
