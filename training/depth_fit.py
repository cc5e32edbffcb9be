"""Offline fit of the adaptive draft-depth rule (reference/depth.py) from recorded rounds.

Records are rounds drafted to depth ≥ max_depth (e.g. generate(..., FixedDepth(7)).rounds).
Replaying a shallower policy on them is exact per round: drafts 1 … d do not depend on whether
later depths run (draft samples and verification uniforms are keyed by position), and
verification accepts a prefix, so a round that accepted a of D drafts accepts min(a, d) of its
first d. It emits min(a, d) + 1 tokens (the replacement or bonus) and costs
cost.time(d) = round + d·(depth + row). Later rounds start from different positions, so the
replay estimates throughput over the recorded distribution of rounds, not one trajectory.

Fit (deterministic): per decision depth j, least squares of 1[a ≥ j+1] on the policy's own
features (reference.depth: cum, q, h, cum·q, cum·h) gives the score weights; the threshold is the
cost model's break-even point λ·(depth + row), with λ the throughput reached (Dinkelbach
iterations from the best fixed depth), then a line search of ±3 octaves in 1/8-octave steps
around it on the same records (the regression's calibration is not trusted); if the best fixed
depth still does better on these records, the rule becomes that fixed depth. Objective:
Σ tokens / Σ time over the records. N rounds, D recorded depths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reference.depth import (
    MAX_DEPTH,
    MIN_DEPTH,
    AdaptiveDepth,
    FixedDepth,
    f32,
    init_features,
    legal_param,
    push_features,
)


@dataclass(frozen=True)
class CostModel:
    depth: float  # time of one draft depth
    round: float  # time of a verification round without drafts (target forward, sampling, …)
    row: float = 0.0  # extra verification time per draft row

    def __post_init__(self) -> None:
        for name in ("depth", "round", "row"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"CostModel.{name}: must be a finite number ≥ 0, got {v!r}")
        if self.round <= 0:
            raise ValueError(f"CostModel.round: must be > 0, got {self.round!r}")

    @property
    def marginal(self) -> float:
        return self.depth + self.row

    def time(self, d: torch.Tensor) -> torch.Tensor:
        return self.round + d.double() * self.marginal


@dataclass(frozen=True)
class Records:
    probs: torch.Tensor  # [N, D] fp32 served q(y_j) of each round's drafts
    entropies: torch.Tensor  # [N, D] fp32
    accepted: torch.Tensor  # [N] int64, a in [0, D]

    @property
    def depth(self) -> int:
        return self.probs.shape[1]

    def features(self) -> list[torch.Tensor]:
        """[j-1] = features after j drafts, [N, 3] fp32, j = 1 … D (the policy's own pipeline)."""
        f, out = init_features(self.probs.shape[0]), []
        for j in range(self.depth):
            f = push_features(f, self.probs[:, j], self.entropies[:, j])
            out.append(f)
        return out


def records_from_rounds(rounds: Sequence, depth: int = MAX_DEPTH) -> Records:
    """Rounds with .drafts (list[DraftInfo]) and .accepted (RoundRecord), cut to `depth`."""
    if not rounds:
        raise ValueError("records_from_rounds: no rounds")
    probs, ents, acc = [], [], []
    for i, r in enumerate(rounds):
        if len(r.drafts) < depth:
            raise ValueError(
                f"round {i}: {len(r.drafts)} drafts, need ≥ {depth} to replay depths up to "
                f"{depth} (record with FixedDepth({depth}))"
            )
        if not 0 <= r.accepted <= len(r.drafts):
            raise ValueError(f"round {i}: accepted={r.accepted} outside [0, {len(r.drafts)}]")
        probs.append([d.prob for d in r.drafts[:depth]])
        ents.append([d.entropy for d in r.drafts[:depth]])
        acc.append(min(r.accepted, depth))
    return Records(
        torch.tensor(probs, dtype=torch.float32),
        torch.tensor(ents, dtype=torch.float32),
        torch.tensor(acc, dtype=torch.int64),
    )


def depths_run(policy: FixedDepth | AdaptiveDepth, rec: Records) -> torch.Tensor:
    """Drafts each round would run under `policy`. → [N] int64"""
    if policy.max_depth > rec.depth:
        raise ValueError(
            f"policy max_depth {policy.max_depth} exceeds the records' depth {rec.depth}"
        )
    n = rec.probs.shape[0]
    if isinstance(policy, FixedDepth):
        return torch.full((n,), policy.depth, dtype=torch.int64)
    d = torch.zeros(n, dtype=torch.int64)
    alive = policy.more_batch(0, init_features(n))
    table = policy.table()
    for j, f in enumerate(rec.features(), start=1):
        d += alive.long()  # depth j ran where still alive
        alive = alive & policy.more_batch(j, f, table)
    return d


@dataclass(frozen=True)
class Evaluation:
    tokens: float  # emitted over all rounds
    time: float  # cost-model time over all rounds
    hist: tuple[int, ...]  # rounds by depth run, index 0 … max

    @property
    def throughput(self) -> float:
        return self.tokens / self.time

    @property
    def mean_depth(self) -> float:
        return sum(i * c for i, c in enumerate(self.hist)) / sum(self.hist)


def evaluate(policy: FixedDepth | AdaptiveDepth, rec: Records, cost: CostModel) -> Evaluation:
    d = depths_run(policy, rec)
    tokens = torch.minimum(rec.accepted, d) + 1
    hist = torch.bincount(d, minlength=rec.depth + 1)
    return Evaluation(float(tokens.sum()), float(cost.time(d).sum()), tuple(hist.tolist()))


def _regression(rec: Records, lo: int, hi: int, ridge: float) -> tuple[tuple[float, ...], ...]:
    feats, rows = rec.features(), []
    for j in range(lo, hi):
        cum, q, h = feats[j - 1].double().unbind(1)
        x = torch.stack([torch.ones_like(cum), cum, q, h, cum * q, cum * h], 1)  # [N, 6]
        y = (rec.accepted >= j + 1).double()  # depth j+1 adds a token iff drafts 1…j+1 accepted
        a = x.T @ x + ridge * x.shape[0] * torch.eye(6, dtype=torch.float64)
        w = torch.linalg.solve(a, x.T @ y)
        rows.append(tuple(legal_param(float(v)) for v in w))
    return tuple(rows)


@dataclass(frozen=True)
class FitReport:
    policy: AdaptiveDepth
    cost: CostModel
    adaptive: Evaluation
    fixed: dict[int, Evaluation]  # depth → evaluation on the same records
    rounds: int

    @property
    def best_fixed(self) -> int:
        return max(self.fixed, key=lambda k: (self.fixed[k].throughput, -k))

    @property
    def gain(self) -> float:
        """Adaptive throughput over the best fixed depth's, minus 1."""
        return self.adaptive.throughput / self.fixed[self.best_fixed].throughput - 1.0

    def summary(self) -> dict:
        """JSON-ready; save_policy(dir, report.policy, report.summary()) stores it beside."""
        return {
            "rounds": self.rounds,
            "cost": {"depth": self.cost.depth, "round": self.cost.round, "row": self.cost.row},
            "adaptive_tokens_per_time": self.adaptive.throughput,
            "adaptive_mean_depth": self.adaptive.mean_depth,
            "adaptive_depth_hist": list(self.adaptive.hist),
            "fixed_tokens_per_time": {str(k): v.throughput for k, v in self.fixed.items()},
            "best_fixed": self.best_fixed,
            "gain_vs_best_fixed": self.gain,
        }

    def table(self) -> str:
        lines = [f"{'policy':<10} {'tokens/time':>12} {'mean depth':>11}"]
        for k, v in self.fixed.items():
            lines.append(f"{'fixed ' + str(k):<10} {v.throughput:>12.5f} {v.mean_depth:>11.2f}")
        a = self.adaptive
        lines.append(f"{'adaptive':<10} {a.throughput:>12.5f} {a.mean_depth:>11.2f}")
        lines.append(f"gain vs best fixed ({self.best_fixed}): {self.gain:+.2%}")
        return "\n".join(lines)


def fit(
    rounds: Sequence | Records,
    cost: CostModel,
    min_depth: int = MIN_DEPTH,
    max_depth: int = MAX_DEPTH,
    ridge: float = 1e-6,
) -> FitReport:
    rec = rounds if isinstance(rounds, Records) else records_from_rounds(rounds, max_depth)
    if rec.depth < max_depth:
        raise ValueError(f"fit: records hold {rec.depth} depths, max_depth={max_depth} needs more")
    if cost.marginal <= 0:
        raise ValueError("fit: CostModel.depth + row must be > 0 (else always run max_depth)")
    fixed = {k: evaluate(FixedDepth(k), rec, cost) for k in range(min_depth, max_depth + 1)}
    weights = _regression(rec, min_depth, max_depth, ridge)

    def trial(theta: float) -> tuple[AdaptiveDepth, Evaluation]:
        p = AdaptiveDepth(weights, legal_param(theta), min_depth, max_depth)
        return p, evaluate(p, rec, cost)

    lam = max(v.throughput for v in fixed.values())
    best = trial(lam * cost.marginal)
    for _ in range(20):  # Dinkelbach: break even at the throughput the rule itself reaches
        if best[1].throughput <= lam:
            break
        lam = best[1].throughput
        nxt = trial(lam * cost.marginal)
        best = nxt if nxt[1].throughput > best[1].throughput else best
    centre = best[0].threshold
    for k in range(-24, 25):  # first best kept on ties: deterministic
        cand = trial(f32(centre * 2.0 ** (k / 8)))
        if cand[1].throughput > best[1].throughput:
            best = cand
    k = max(fixed, key=lambda d: (fixed[d].throughput, -d))
    if fixed[k].throughput > best[1].throughput:  # the score found nothing: stay at fixed k
        p = fixed_as_adaptive(k, min_depth, max_depth)
        best = p, evaluate(p, rec, cost)
    return FitReport(best[0], cost, best[1], fixed, rec.probs.shape[0])


def fixed_as_adaptive(k: int, min_depth: int = MIN_DEPTH, max_depth: int = MAX_DEPTH):
    """FixedDepth(k) written as an adaptive rule: bias 1 before depth k, 0 from it, θ = 1/2."""
    if not min_depth <= k <= max_depth:
        raise ValueError(f"fixed_as_adaptive: depth {k} outside [{min_depth}, {max_depth}]")
    rows = tuple((1.0 if j < k else 0.0,) + (0.0,) * 5 for j in range(min_depth, max_depth))
    return AdaptiveDepth(rows, 0.5, min_depth, max_depth)
