"""Draft-depth policies: after each draft depth, decide whether to run another.

A policy sees only the drafts generated so far in this round (their served probabilities and
entropies); it never discards a draft already generated. The adaptive policy (issue 4) plugs in
here; the reference ships the fixed policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftInfo:
    token: int
    prob: float  # q(token): the draft's served probability of its own sample
    entropy: float  # of the served distribution q at this depth, in nats


class DepthPolicy(Protocol):
    max_depth: int

    def more(self, drafts: list[DraftInfo]) -> bool:
        """After len(drafts) depths have run: launch another depth?"""
        ...


@dataclass(frozen=True)
class FixedDepth:
    """Always exactly `depth` drafts (0 = plain decoding, no speculation)."""

    depth: int

    def __post_init__(self) -> None:
        if not 0 <= self.depth <= 16:
            raise ValueError(f"draft depth must be in [0, 16], got {self.depth}")

    @property
    def max_depth(self) -> int:
        return self.depth

    def more(self, drafts: list[DraftInfo]) -> bool:
        return len(drafts) < self.depth
