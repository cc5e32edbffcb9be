"""Launch configuration of the residual/norm tails (kernels/tails.py), pinned per shape (no
autotuning): warps, router blocks, and the row programs' 128-column groups."""

from __future__ import annotations

from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class TailLaunch:
    num_warps: int = 8
    route_rows: int = 8  # rows per router program; fixed so padded and exact widths match bits
    block_e: int = 4  # experts per router program
    block_k: int = 128  # hidden columns per router step
    unroll_k: bool = False  # router: poll all of its input at once (see _router_program)
    packed_topk: bool = False  # router finish: one int64 max per top-k step (_route_finish)
    prefetch_w: bool = False  # router: all weight chunks loaded before the first wait
    count_ready: bool = False  # router: wait on a row counter, not on r_in's NaN (router.py)
    # router finish: softmax and top-k over warp-sized tiles, each row's reductions inside
    # one warp (kernels/router.py _softmax_topk_groups)
    group_finish: bool = False
    # row programs of the MoE / attention tail: 0 = one program per row; g = programs of g
    # 128-column groups each, joined by a per-row arrival counter (kernels/row_chunks.py); the
    # same bits either way
    moe_chunk_groups: int = 0
    attn_chunk_groups: int = 0
    # with PDL: the MoE tail lets the next launch (the next layer's QKV projection) start at
    # once, so its programs can prefetch their weights (LinearLaunch.prefetch_w) while the tail
    # runs (kernels/launch.py pdl_enter RELEASE); needs pdl; changes no bit. Off: see
    # LinearLaunch.prefetch_w
    moe_release: bool = False

    def __post_init__(self) -> None:
        for name in ("moe_chunk_groups", "attn_chunk_groups"):
            g = getattr(self, name)
            if g < 0 or (g and g & (g - 1)):
                raise ValueError(f"TailLaunch.{name}: 0 or a power of two, got {g}")
        if self.packed_topk and self.group_finish:
            raise ValueError("TailLaunch: packed_topk and group_finish are two ways of one "
                             "top-k; choose one")


def tail_launch(hidden: int, experts: int = 0) -> TailLaunch:
    """E ≥ 64 (the real E = 256: 128 router programs of 2 experts, 3 steps of 1024 columns):
    20.0 µs per attention tail with router on the H200 vs 50.7 µs for 4 experts × 128 columns
    (6 of 8 rows, N = 8; `bench_tails --sweep`, reports/benchmarks/h200-2026-11-29/session3/);
    the router programs' wait is a chain of volatile loads, one link per step.
    Every shape: the ready counter and the group finish; E ≥ 64 also the weights prefetched
    before the wait. On the H100 (reports/benchmarks/h100-2026-12-06b/, `exp_tail_timeline`,
    6 of 8 rows, N = 8): 19.54 µs per attention tail with router as NaN readiness and the
    full-tile finish, 17.39 with the counter, 16.40 with the group finish too, 15.32 with the
    prefetch too; block_e 4 (17.49) and block_k 512 (17.16) lose. In the rank round
    (`benchmarks.rank --launch tails.count_ready=1,tails.group_finish=1`, alternating) the
    counter and group finish are 2.2–3.0 % faster rounds in 4 of 4 pairs (widths 6 / 8 × 1K /
    4K).
    The MoE tail in chunks of 2 groups (256 columns: 12 programs per row at H = 3072): on the
    H100 0.7–1.1 % faster rounds than one program per row (widths 6 / 8 × 1K / 4K), chunks of 2
    ahead of 4 and 8 (reports/benchmarks/h100-2026-12-06c/, measured on the chunk design of
    637a31f); on the H200 at 70dd9f0 (reports/benchmarks/h200-2026-12-06c/, alternating in the
    round) one program per row is 6.8–7.7 % slower than chunks of 2 at widths 6 / 8 × 1K / 4K,
    and the round 1.0–1.1 % faster than 6e8ae0c's (separate processes). The attention tail's
    chunks (attn_chunk_groups) stay off: 2 and 4 groups are 1.0–1.6 % slower rounds there."""
    if experts >= 64:
        return TailLaunch(block_e=2, block_k=min(1024, pow2(hidden)), count_ready=True,
                          group_finish=True, prefetch_w=True, moe_chunk_groups=2)
    return TailLaunch(block_e=8, block_k=min(128, pow2(hidden)), count_ready=True,
                      group_finish=True, moe_chunk_groups=2)


def chunk_grid(groups: int, hidden: int) -> tuple[int, int]:
    """(columns per row-chunk program, programs per row) for chunks of `groups` 128-column
    groups (0: one program per row)."""
    if not groups or 128 * groups >= hidden:
        return block_h(hidden), 1
    chunk = 128 * groups
    return chunk, -(-hidden // chunk)


def topk_mode(cfg: TailLaunch) -> int:
    """The router finish's TOPK constexpr (kernels/router.py _route_finish): 0 steps, 1 packed
    steps, 2 steps over warp-sized groups."""
    return 2 if cfg.group_finish else int(cfg.packed_topk)


def pow2(x: int) -> int:
    return triton.next_power_of_2(x)


def groups(hidden: int) -> int:
    """128-column groups of a row program, a power of two (kernels.fp8.quantize_row)."""
    return pow2(-(-hidden // 128))


def block_h(hidden: int) -> int:
    """A row program's columns: whole 128-column groups, so the row it holds in registers
    reshapes to [groups, 128] for the quantization (kernels.fp8.quantize_row)."""
    return 128 * groups(hidden)
