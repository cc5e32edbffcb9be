"""Paired bootstrap confidence intervals for experiment summaries.

The unit of resampling is the pair: one (prompt, seed) measured under both arms. Every resample
draws n pair indices with replacement and applies the same indices to both arms, so whatever
varies between prompts (length, acceptance, cache size) cancels in the paired statistic instead
of widening the interval. Intervals are percentile intervals (linear interpolation between order
statistics) of `resamples` resampled statistics; the indices come from a seeded
torch.Generator, so a summary is reproducible bit for bit.

Statistics: the ratio of means Σcand / Σctrl (time per output token, round latency) and the
mean paired difference mean(cand − ctrl) (accepted length).

Dimension letters: n pairs, B resamples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

DEFAULT_RESAMPLES = 10_000
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    estimate: float
    lo: float
    hi: float
    level: float
    resamples: int

    def contains(self, x: float) -> bool:
        return self.lo <= x <= self.hi

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "lo": self.lo, "hi": self.hi, "level": self.level,
                "resamples": self.resamples}


def resample_indices(n: int, resamples: int, seed: int) -> torch.Tensor:
    """[B, n] int64 pair indices, uniform with replacement."""
    if n < 1:
        raise ValueError(f"bootstrap: need at least 1 pair, got {n}")
    if resamples < 1:
        raise ValueError(f"bootstrap: resamples must be >= 1, got {resamples}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (resamples, n), generator=g)


def _values(x: Sequence[float], name: str) -> torch.Tensor:
    t = torch.as_tensor(list(x), dtype=torch.float64)
    if t.ndim != 1 or not bool(torch.isfinite(t).all()):
        raise ValueError(f"bootstrap: {name} must be a list of finite numbers")
    return t


def _pair(ctrl, cand) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _values(ctrl, "control"), _values(cand, "candidate")
    if a.shape != b.shape:
        raise ValueError(f"bootstrap: {a.shape[0]} control and {b.shape[0]} candidate values; "
                         "paired statistics need one of each per pair")
    return a, b


def percentile_interval(estimate: float, stats: torch.Tensor, level: float) -> Interval:
    """stats [B] float64 resampled statistics → the central `level` percentile interval."""
    if not 0 < level < 1:
        raise ValueError(f"bootstrap: level must be in (0, 1), got {level}")
    a = (1 - level) / 2
    q = torch.quantile(stats, torch.tensor([a, 1 - a], dtype=torch.float64))
    return Interval(float(estimate), float(q[0]), float(q[1]), level, stats.shape[0])


def ratio_of_means(ctrl: Sequence[float], cand: Sequence[float], *,
                   resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL,
                   seed: int = 0) -> Interval:
    """Σcand / Σctrl over pairs, with its paired bootstrap interval (control sums must be > 0)."""
    a, b = _pair(ctrl, cand)
    if not bool((a > 0).all()):
        raise ValueError("bootstrap: ratio of means needs positive control values")
    idx = resample_indices(a.shape[0], resamples, seed)  # [B, n]
    stats = b[idx].sum(dim=1) / a[idx].sum(dim=1)  # [B]
    return percentile_interval(float(b.sum() / a.sum()), stats, level)


def mean_difference(ctrl: Sequence[float], cand: Sequence[float], *,
                    resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL,
                    seed: int = 0) -> Interval:
    """mean(cand − ctrl) over pairs, with its paired bootstrap interval."""
    a, b = _pair(ctrl, cand)
    d = b - a  # [n]
    idx = resample_indices(d.shape[0], resamples, seed)
    return percentile_interval(float(d.mean()), d[idx].mean(dim=1), level)
