"""Launch configuration of the dense projections (kernels/linear.py): channels per program,
split-K, stages; pinned for the per-rank TP8 shapes of IQuest-Q1, a default elsewhere."""

from __future__ import annotations

from dataclasses import dataclass

import triton

from reference.params import FP8_BLOCK

TARGET_PROGRAMS = 128  # split K until the grid has about this many programs (132 SMs)


@dataclass(frozen=True)
class LinearLaunch:
    block_n: int  # output channels per program (power of two ≥ 16)
    split_k: int  # requested K splits; the effective count is split_plan(...)[0]
    block_k: int = 128  # columns per K step (FP8: exactly one 128-column scale block)
    num_warps: int = 4
    num_stages: int = 3
    reduce_block: int = 1024  # channels per program of the split-K reduction
    # FP8: a split's row and weight scales loaded before its K loop (kernels/linear.py
    # fp8_program HOIST): the same bits. Off: with the MoE hoists 8–12 % slower rounds on the
    # H100 (reports/benchmarks/h100-2026-12-07/)
    hoist_scales: bool = False
    # FP8: x and its scales read for every buffer row, so no load waits for the live row count
    # (kernels/linear.py fp8_program EARLY): the same bits for the live rows. Off: within ±0.4 %
    # on the H100, once 3.8 % slower (reports/benchmarks/h100-2026-12-07/)
    early_loads: bool = False
    # FP8 with PDL: each program prefetches its weight slice into L2 before its PDL wait
    # (kernels/launch.py prefetch_l2), so a predecessor that releases it early
    # (TailLaunch.moe_release) hides the weight stream; needs pdl; changes no bit. Off: the
    # pair is 0.9–1.4 % slower on the H100 (reports/benchmarks/h100-2026-12-07/)
    prefetch_w: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "reduce_block"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"LinearLaunch.{name}: expected a power of two >= 16, got {v}")
        if self.split_k < 1:
            raise ValueError(f"LinearLaunch.split_k: expected >= 1, got {self.split_k}")


def split_plan(k_blocks: int, split_k: int) -> tuple[int, int]:
    """(S, KB): S splits of KB column blocks each (the last may be shorter, never empty)."""
    kb = -(-k_blocks // max(1, min(split_k, k_blocks)))
    return -(-k_blocks // kb), kb


# Per-rank TP8 shapes (N, K) of IQuest-Q1, pinned; everything else follows _default_launch.
_PINNED_FP8: tuple[tuple[tuple[int, int], LinearLaunch], ...] = (
    ((1024, 3072), LinearLaunch(64, 8)),  # QKV: 16 tiles × 8 splits of 3 blocks
    ((3072, 768), LinearLaunch(64, 3)),  # O: 48 tiles × 3 splits of 2 blocks
    ((1536, 3072), LinearLaunch(64, 6)),  # dense gate or up: 24 tiles × 6 splits of 4 blocks
    ((3072, 3072), LinearLaunch(64, 3)),  # dense gate+up fused: 48 tiles × 3 splits of 8
    ((3072, 1536), LinearLaunch(64, 3)),  # dense down: 48 tiles × 3 splits of 4 blocks
    ((20000, 3072), LinearLaunch(64, 1)),  # quantized lm_head shard: 313 tiles
)
_PINNED_BF16: tuple[tuple[tuple[int, int], LinearLaunch], ...] = (
    ((20000, 3072), LinearLaunch(64, 1, num_stages=4)),  # lm_head shard: 313 tiles
    ((3072, 6144), LinearLaunch(64, 3)),  # draft eh_proj: 48 tiles × 3 splits of 16 blocks
)


def _default_launch(n: int, k: int, block_k: int) -> LinearLaunch:
    bn = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    tiles = -(-n // bn)
    return LinearLaunch(bn, max(1, -(-TARGET_PROGRAMS // tiles)), block_k)


def linear_fp8_launch(n: int, k: int) -> LinearLaunch:
    return dict(_PINNED_FP8).get((n, k)) or _default_launch(n, k, FP8_BLOCK)


def linear_bf16_launch(n: int, k: int) -> LinearLaunch:
    return dict(_PINNED_BF16).get((n, k)) or _default_launch(n, k, 128)
