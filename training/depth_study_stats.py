"""Statistics of the depth study (training/depth_study.py): the cost model, per-policy
totals of the held-out runs, the paired bootstrap, the replay on depth-7 rounds and the
verdict.

Cost model (time units: µs on the H200, CUDA-graph rounds of the mini model): a round with
d drafts costs base + d·marginal. Tokens of a round are a + 1 (accepted drafts plus the
replacement or bonus), before budget trimming, so a run's last round counts in full.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from reference.depth import FixedDepth
from reference.speculative import GenerationResult
from training.depth_fit import CostModel, Evaluation, evaluate, records_from_rounds

if TYPE_CHECKING:
    from training.depth_study_config import StudyConfig

FIXED = (3, 4, 5, 6, 7)
REPO = Path(__file__).resolve().parents[1]
# a copy of the record reports/benchmarks/h200-2026-11-29/session2/bench_round_mini.json
# (data/costs/README.md)
BENCH = REPO / "data/costs/bench_round_mini_h200.json"


def cost_from_benchmark(path: Path = BENCH) -> tuple[CostModel, dict]:
    """base + d·marginal through the graph rounds at depths 3 and 5 of a bench_round JSON."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
        us = {r["depth"]: r["round_us"] for r in rows if r.get("graphs") is True}
        r3, r5 = float(us["3"]), float(us["5"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: need graph rows of depths '3' and '5' with round_us ({e!r})") from None
    marginal = (r5 - r3) / 2
    base = r3 - 3 * marginal
    path = Path(path).resolve()
    path = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    text = (f"graph round {r3:.0f} µs at depth 3, {r5:.0f} µs at depth 5 ({path}) → "
            f"({r5:.0f} − {r3:.0f}) / 2 = {marginal:.1f} µs per extra depth incl. its "
            f"verification row; base = {r3:.0f} − 3·{marginal:.1f} = {base:.1f} µs")
    # depth_fit only uses depth + row: the benchmark cannot split the two, so row = 0
    return CostModel(depth=marginal, round=base), {"source": str(path), "round_us_d3": r3,
                                                   "round_us_d5": r5, "text": text}


def run_totals(row: dict, cost: CostModel) -> tuple[float, int, int, int]:
    """(modeled time, tokens = Σ(a+1), rounds, drafts run) of one run row."""
    d = [int(c) for c in row["depths"]]
    a = [int(c) for c in row["accepted"]]
    return len(d) * cost.round + sum(d) * cost.marginal, sum(a) + len(a), len(d), sum(d)


def by_policy(rows: Sequence[dict], cost: CostModel) -> dict[str, dict]:
    acc: dict[str, list] = {}
    for r in rows:
        acc.setdefault(r["policy"], []).append(run_totals(r, cost))
    out = {}
    for label, xs in acc.items():
        t, n, k, d = (sum(x[i] for x in xs) for i in range(4))
        out[label] = {"time_per_token": t / n, "tokens_per_round": n / k,
                      "drafts_per_round": d / k, "rounds": k, "tokens": n, "time": t}
    return out


def pair_arrays(rows: Sequence[dict], cost: CostModel, label: str):
    """[P] modeled time and [P] tokens of one policy, pairs in (prompt, seed) order."""
    xs = sorted(((r["prompt"], r["seed"]), run_totals(r, cost)) for r in rows
                if r["policy"] == label)
    return (torch.tensor([x[1][0] for x in xs], dtype=torch.float64),
            torch.tensor([x[1][1] for x in xs], dtype=torch.float64))


def bootstrap_ratio(ta, na, fixed: dict, boot: int, seed: int) -> dict:
    """Ratio of time per token, adaptive (ta, na [P]) over each fixed policy's (fixed: label →
    (t, n) [P], same pair order): the point estimate, a percentile 95% CI resampling pairs, and
    the CI against the best fixed policy re-chosen in every replicate."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, ta.shape[0], (boot, ta.shape[0]), generator=g)  # [B, P]
    rate_a = ta[idx].sum(1) / na[idx].sum(1)  # [B]
    rates = {k: t[idx].sum(1) / n[idx].sum(1) for k, (t, n) in fixed.items()}

    def ci(x: torch.Tensor) -> list[float]:
        s = torch.sort(x).values
        return [float(s[round(0.025 * (boot - 1))]), float(s[round(0.975 * (boot - 1))])]

    point = {k: float((ta.sum() / na.sum()) / (t.sum() / n.sum())) for k, (t, n) in fixed.items()}
    best = torch.stack(list(rates.values())).min(0).values
    return {"point": point, "ci95": {k: ci(rate_a / r) for k, r in rates.items()},
            "ci95_best_rechosen": ci(rate_a / best), "boot": boot, "seed": seed}


def replay(results: Sequence[GenerationResult], policies: dict, cost: CostModel) -> dict:
    """Policies replayed on depth-7 rounds (training.depth_fit.evaluate): µs per token."""
    rec = records_from_rounds([r for res in results for r in res.rounds], 7)
    ev: dict[str, Evaluation] = {k: evaluate(p, rec, cost) for k, p in policies.items()}
    return {k: {"time_per_token": 1 / e.throughput, "mean_depth": e.mean_depth}
            for k, e in ev.items()}


def heldout_summary(rows: list[dict], results: list, adaptive, cost: CostModel,
                    cfg: StudyConfig) -> dict:
    agg = by_policy(rows, cost)
    fixed = [f"fixed-{k}" for k in FIXED]
    best = min(fixed, key=lambda k: (agg[k]["time_per_token"], k))
    ta, na = pair_arrays(rows, cost, "adaptive")
    arrays = {k: pair_arrays(rows, cost, k) for k in fixed}
    ratio = bootstrap_ratio(ta, na, arrays, cfg.boot, cfg.boot_seed)
    ra, rb = ta / na, arrays[best][0] / arrays[best][1]  # [P] per-pair time per token
    d7 = [res for row, res in zip(rows, results, strict=True) if row["policy"] == "fixed-7"]
    pols = {f"fixed-{k}": FixedDepth(k) for k in range(1, 8)} | {"adaptive": adaptive}
    return {"by_policy": agg, "best_fixed": best, "ratio": ratio, "pairs": int(ta.shape[0]),
            "vs_best_pairs": {"faster": int((ra < rb).sum()), "equal": int((ra == rb).sum()),
                              "slower": int((ra > rb).sum())},
            "replay_on_fixed7_rounds": replay(d7, pols, cost)}


def verdict(h: dict) -> str:
    b = h["best_fixed"]
    r, (lo, hi) = h["ratio"]["point"][b], h["ratio"]["ci95"][b]
    how = ("faster than" if hi < 1 else "slower than" if lo > 1 else
           "not distinguishable from")
    return (f"adaptive / best fixed ({b}) modeled time per token = {r:.3f} "
            f"(95% CI {lo:.3f} … {hi:.3f}): the adaptive rule is {how} the best fixed depth "
            f"on these held-out pairs")
