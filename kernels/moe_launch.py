"""Launch configuration of the block-FP8 MoE (kernels/moe.py): tile sizes, warps, stages and the
gate/up K split, pinned per shape and device type."""

from __future__ import annotations

from dataclasses import dataclass

import triton

from kernels.fp8 import blocks


@dataclass(frozen=True)
class MoeLaunch:
    gate_up_block_n: int  # intermediate channels per gate/up program (each of gate and up)
    down_block_n: int  # hidden channels per down program
    combine_block_h: int  # hidden channels per combine program
    num_warps: int = 4  # SiLU and combine programs
    gate_up_stages: int = 3
    down_stages: int = 2  # down's K loop is only ⌈I/128⌉ = 2 blocks long
    gate_up_k_blocks: int = 1 << 30  # 128-column hidden blocks per gate/up K split
    gate_up_warps: int = 4
    down_warps: int = 4
    # launches 3 and 5 folded into 2 and 4 by arrival counters (kernels/moe.py _fold_silu,
    # _fold_combine): same bits, fewer launches, but slower on the H200 — see moe_launch
    fold_silu: bool = False
    fold_combine: bool = False
    # launch 3 recomputed inside launch 4: each down program makes its rows' SiLU·up and
    # quantization from the gate/up partials (kernels/moe.py _silu_cols): the same bits, no
    # launch 3 and no counters. Row-major (down_rows) at the TP8 shape it needs down_stages 2:
    # each stage holds the partials' tiles, 282 KB of shared memory at 3 (sm_90 allows 227)
    silu_in_down: bool = False
    # launches 4 and 5 as one row-major launch: program (row, hidden tile) walks the row's K
    # experts and sums in registers (kernels/moe.py _moe_down_rows_kernel): the same bits, no
    # y buffer, no counters; an expert shared by rows is streamed once per row (L2 after the
    # first)
    down_rows: bool = False
    # down_rows' expert ids, router weights and scales loaded before its expert loop, so the
    # loop waits only on the tiles the pipeliner carries (kernels/moe.py _down_rows_hoisted):
    # the same bits; needs down_rows on aq, sa (not silu_in_down). Off: 1.3–3.9 % slower
    # rounds with gate_up_hoist on the H100 (reports/benchmarks/h100-2026-12-07/)
    down_hoist: bool = False
    # down_rows' expert ids loaded before its expert loop (kernels/moe.py
    # _moe_down_rows_kernel IDS_AHEAD), the scales still in it: the only in-loop load a tile
    # address waited for, so Triton's pipeliner can overlap the next expert's tiles with this
    # one's MMAs (≥ 3 stages); the same bits. The slot-major down (down_rows off) and the
    # hoisted one (down_hoist) load their ids before their loops anyway: for them it is a no-op
    down_ids_ahead: bool = False
    # down_rows' next expert's weight and operand scales and router weight loaded during this
    # expert (kernels/moe.py _moe_down_rows_kernel SCALES_AHEAD, its ids ahead too): a pass of
    # the pinned loop waits for loads it issued itself 6 times, three round trips in series
    # (sm_90 SASS), ≈ the 1.1–1.3 µs per expert the H200's stamps show
    # (reports/benchmarks/h200-2026-12-07/); ahead, 3 times for loads all issued at the pass's
    # top (a tile read sharing their scoreboard mid-pass, the carried registers' refill at its
    # end) — without the hoist's K-wide register tiles; the same bits. Needs down_rows on aq,
    # sa (not down_hoist, not silu_in_down) and I ≤ 256. Off: an expert step 1.25 vs 1.28–1.39
    # µs at 6 rows, rounds 0.0–0.4 % faster on the H100 (reports/benchmarks/h100-2026-12-07c/):
    # at 6–8 rows the step streams its rows' experts at the copy bandwidth, so the waits were
    # not what it costs
    down_scales_ahead: bool = False
    # gate/up's activation and weight scales loaded before its K loop, likewise
    # (kernels/moe.py _gate_up_loop HOIST): the same bits. Alone on the H100: block 0 5.86 →
    # 2.86 µs at 6 rows, the launch no shorter (its second wave still starts at ≈ 15 µs;
    # reports/benchmarks/h100-2026-12-07c/)
    gate_up_hoist: bool = False
    # the routing ids (and, row-major with down_hoist, the row's router weights and operand
    # scales) loaded for every buffer row without waiting for the live row count, so the expert
    # weights' addresses wait for one round trip, not a chain of them (kernels/moe.py
    # _slot_route_early): gate/up and the slot-major down always, the row-major down with
    # down_hoist; the same bits. Off: 1.2–1.5 % faster rounds at width 8 but 0.6–1.0 % slower
    # at width 6 on the H100 (reports/benchmarks/h100-2026-12-07/)
    early_loads: bool = False
    # gate/up's grid in one dimension, program w taking work item (distinct expert, channel
    # tile, K split) w: the programs with work come first whatever the routing, so the block
    # scheduler makes them resident before any program that exits (kernels/moe.py
    # _moe_gate_up_kernel COMPACT): the same bits. On the H200 the slot grid's gate/up runs in
    # two waves at 6–8 rows: 8 buffer rows' 1 536 programs where 10 fit per SM (1 320), and one
    # SM ran 11 of the 1 056 with work (reports/benchmarks/h200-2026-12-07/). Not with
    # fold_silu or early_loads. Off: one wave, but every refill block slower (all programs
    # draw on HBM at once); rounds 2.7–7.2 % slower at width 6 on the H100
    # (reports/benchmarks/h100-2026-12-07c/)
    gate_up_compact: bool = False
    # launch 3 (SiLU·up + quantization, moe_fp8) asks L2 for the down weights proj[e] of each
    # live row's first silu_prefetch experts before its own work (kernels/moe.py
    # _moe_silu_kernel PREFETCH; a hint, the same bits; compiled kernels only). The down's
    # expert steps stream at the copy bandwidth at 6–8 rows, but its first step takes ≈ 2 µs
    # longer (reports/benchmarks/h100-2026-12-07c/): started during launch 3 and launch 4's
    # start, those bytes are in L2 when the down's first tiles ask. 0: off. moe_fp8 only: the
    # staged moe_gate_up_fp8 is given no down weights, and with the same config asks for none
    silu_prefetch: int = 0

    def __post_init__(self) -> None:
        for name in ("gate_up_block_n", "down_block_n", "combine_block_h"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoeLaunch.{name}: expected a power of two >= 16, got {v}")
        for name in ("num_warps", "gate_up_warps", "down_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"MoeLaunch.{name}: expected a power of two >= 1, got {v}")
        if self.fold_silu and self.silu_in_down:
            raise ValueError("MoeLaunch: fold_silu and silu_in_down both move launch 3; set "
                             "at most one")
        if self.fold_combine and self.down_rows:
            raise ValueError("MoeLaunch: fold_combine and down_rows both move launch 5; set "
                             "at most one")
        if self.down_hoist and not (self.down_rows and not self.silu_in_down):
            raise ValueError("MoeLaunch.down_hoist: hoists the row-major down's loads; needs "
                             "down_rows on and silu_in_down off")
        if self.down_scales_ahead and not (self.down_rows and not self.silu_in_down
                                           and not self.down_hoist):
            raise ValueError("MoeLaunch.down_scales_ahead: loads the row-major down's scales "
                             "one expert ahead; needs down_rows on, silu_in_down and "
                             "down_hoist off")
        if self.gate_up_compact and (self.fold_silu or self.early_loads):
            raise ValueError("MoeLaunch.gate_up_compact: the compact gate/up has its own "
                             "routing and no per-slot arrival; set fold_silu and early_loads "
                             "off")
        if not (isinstance(self.silu_prefetch, int) and 0 <= self.silu_prefetch <= 64):
            raise ValueError(f"MoeLaunch.silu_prefetch: expected an int in 0..64 (experts per "
                             f"row), got {self.silu_prefetch!r}")
        if self.silu_prefetch and (self.fold_silu or self.silu_in_down):
            raise ValueError("MoeLaunch.silu_prefetch: prefetches from launch 3; set fold_silu "
                             "and silu_in_down off")
        if self.gate_up_k_blocks < 1:
            raise ValueError(f"MoeLaunch.gate_up_k_blocks: expected >= 1, got "
                             f"{self.gate_up_k_blocks}")

    def k_blocks(self, hidden: int) -> int:
        """128-column hidden blocks per gate/up K split at this hidden size."""
        return min(self.gate_up_k_blocks, blocks(hidden))

    def k_splits(self, hidden: int) -> int:
        """KS: gate/up partials per slot (hidden blocks of 128 columns, k_blocks each)."""
        return -(-blocks(hidden) // self.k_blocks(hidden))


def moe_launch(hidden: int, inter: int, device_type: str = "cuda") -> MoeLaunch:
    """Pinned: a pure function of the shape and the device type, no autotuning.
    device_type "cpu" (the Triton interpreter, which runs programs one after another at a cost
    per program): one channel tile per slot in both GEMMs and no K split — the fewest programs.
    Channel tiles change no accumulation order (each output element sums over K the same way),
    so only the split changes bits, within the tolerance rows; CPU tests still cover tiles and
    splits through explicit configs.
    device_type "cuda": chosen on the H200
    (reports/benchmarks/h200-2026-12-01/session9/exp_moe*.log, whole MoE as CUDA-graph replays
    streaming the experts from HBM): per TP8 rank (H 3072, I 192) gate/up in 32-channel tiles
    split into 4 K chunks of 6 blocks, 2 warps, 3 stages; down (then slot-major) in 64-channel
    tiles, 2 warps:
    21.8 / 34.6 / 41.5 µs at 1 / 6 / 8 rows (8 / 35 / 45 distinct experts) vs 35.9 / 45.5 / 48.6
    µs for 32 / 128 tiles with 4 warps and no split (3 splits: 22.0 / 35.6 /
    40.0; 4 warps: 21.9 / 38.1 / 44.5 with 6 splits).
    Folds off (reports/benchmarks/moe-fold-h200/, `bench_moe --fold-ab`, graphs alternating):
    at 1 / 4 / 6 / 8 rows the separate SiLU and combine launches take 23.8 / 34.2 / 42.8 /
    50.5 µs; SiLU folded +2.0 / +3.6 / +4.0 / +4.4 µs, combine folded +1.3 / +4.4 / +8.5 /
    +8.3 µs, both +3.4 / +8.0 / +12.4 / +12.6 µs. The fold puts an acq_rel atomic (and, for the
    last arrival, dependent volatile loads) at the end of every program, on the critical path
    of ≈ 1 000–2 300 short programs, which costs more than the ≈ 2 µs launch it removes.
    down_rows on (reports/benchmarks/h100-2026-12-05/): inside the rank round (`benchmarks.rank
    --launch moe.down_rows=1`, H100, alternating) rounds 0.8–2.2 % faster at widths 6 and 8
    over 1K–16K (6 of 6 pairs; 1 161 → 1 069 launches at width 6); standalone (`bench_moe
    --variant down_rows=1`) 28.7 / 39.0 / 47.8 / 54.7 µs vs 23.7 / 39.1 / 49.6 / 59.3 µs at 1 /
    4 / 6 / 8 rows — slower for the draft's single row, but the round gains. silu_in_down stays
    off: 76 / 192 / 264 / 336 µs at the same rows (every down tile recomputes its rows'
    SiLU·up and quantization). With down_rows, down in 32-channel tiles (`--launch
    moe.down_block_n=…` in the round, H100, 4 of 4 pairs at widths 6 / 8, 1K / 4K): 32 channels
    1.6–1.9 % faster rounds than 64; 128 channels 3.0–3.6 % slower; 4 warps 2.0–2.6 % slower;
    3 stages ±0.2 % — of a loop that does not pipeline at any stage count (its expert id is
    loaded in it). down_ids_ahead at 3 stages (the ids before the loop: expert k+1's tiles in
    flight during expert k's MMAs; reports/benchmarks/h100-2026-12-07b/, H100): standalone
    26.0 / 43.8 / 49.6 µs vs 27.6 / 45.5 / 50.7 µs at 1 / 6 / 8 rows (4 stages 26.5 / 45.4 /
    51.3, down_hoist at 3 stages 27.9 / 46.1 / 50.8); in the round 0.5–0.9 % faster in 4 of 4
    pairs at widths 6 / 8, 1K / 4K — pinned."""
    if device_type == "cpu":
        return MoeLaunch(
            gate_up_block_n=max(16, triton.next_power_of_2(inter)),
            down_block_n=max(16, min(1024, triton.next_power_of_2(hidden))),
            combine_block_h=min(512, max(16, triton.next_power_of_2(hidden))),
        )
    return MoeLaunch(
        gate_up_block_n=32,
        down_block_n=32,
        combine_block_h=min(512, max(16, triton.next_power_of_2(hidden))),
        gate_up_stages=3,
        down_stages=3,
        gate_up_k_blocks=6,
        gate_up_warps=2,
        down_warps=2,
        down_rows=True,
        down_ids_ahead=True,
    )
