"""A row program spread over column-chunk programs inside one launch: each of K programs of a row
sums its chunk of the row's rank partials and stages it, and the last of them to arrive on a
per-row counter runs the row's own program on the staged row (the tails of kernels/tails.py,
with TailLaunch.moe_chunk_groups / attn_chunk_groups).

Why: one program per row pulls the row's N rank partials through one SM (≈ 46 GB/s per SM on
the H100 at N = 24, reports/benchmarks/h100-2026-12-06b/); K chunk programs pull them through K
SMs. Every chunk program of a live row:

  1. stores its chunk of the rounded partial sum (bf16, into a buffer the row's outputs later
     overwrite) and whether its partials were ready (`ok[row, chunk]`);
  2. arrives on `arrive[row]` (acq_rel, after a barrier: every thread's stores are issued);
  3. the program that sees K − 1 there — every other chunk's stores are visible to it — puts
     the counter back to 0, reloads the staged row (volatile: not from a cache that missed the
     others' stores) and runs the one-program-per-row code on it, with the row ready iff every
     chunk was.

Bits: the staged values are the bf16-rounded sums the row program rounds anyway, and the last
arrival's row code has the row program's shape, layout and warps, so its reductions (the norm's
Σx²) add in the same order: every K gives the one-program-per-row bits
(tests/kernels/test_row_chunks.py).

A chunk whose partials never became ready arrives anyway, so the counter always completes; the
row then comes out NaN as with one program per row, and the scratch keeps its invariant.
Nobody waits on anybody, so the order in which the grid runs does not matter (the Triton
interpreter runs the programs one after another).

Scratch invariant between launches: every counter 0 (`ok` needs none: it is written before it is
read in the same launch). Launches of one stream never overlap (with PDL the next launch waits
for this one's completion before its first load), so the next launch starts from it.

Dimension letters: R rows, K chunks per row (KP: K rounded up to a power of two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arrival import last_arrival
from kernels.fp8 import bf16_rne

MAX_CHUNKS = 32  # chunk programs per row (a row of H ≤ 4096 in chunks of ≥ 128 columns)
MAX_ROWS = 64


@dataclass(frozen=True)
class RowChunkScratch:
    """The per-row arrival counters and chunk readiness; made once per device, reused by every
    call (a captured graph replays it)."""

    arrive: torch.Tensor  # [MAX_ROWS] int32, 0 between launches
    ok: torch.Tensor  # [MAX_ROWS, MAX_CHUNKS] int32: the current launch's chunk readiness

    @classmethod
    def create(cls, device) -> RowChunkScratch:
        return cls(torch.zeros(MAX_ROWS, dtype=torch.int32, device=device),
                   torch.zeros(MAX_ROWS, MAX_CHUNKS, dtype=torch.int32, device=device))

    def reset(self) -> None:
        """After an aborted launch (device synchronized): every counter 0."""
        self.arrive.zero_()


@triton.jit
def stage_row(stage_ptr, stride_stage, ok_ptr, arrive_ptr, stride_ok, row, chunk, cols, cmask,
              acc, ready, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, K: tl.constexpr,
              KP: tl.constexpr):
    """Steps 1–3 for program (row, chunk) of a live row, acc [CHUNK] its FP32 partial sum →
    (whether it is the row's last arrival; if so the row's staged bf16(Σ) [BLOCK_H] as FP32 —
    in the layout of a row program's arange(BLOCK_H), so the row code reduces it in that
    program's order — and the row's readiness; zeros otherwise)."""
    tl.store(stage_ptr + row * stride_stage + cols, bf16_rne(acc), mask=cmask)
    last = arrive_last(ok_ptr, arrive_ptr, row, chunk, ready, stride_ok, K)
    every = tl.arange(0, BLOCK_H)
    staged = tl.load(stage_ptr + row * stride_stage + every, mask=(every < HIDDEN) & last,
                     other=0.0, volatile=True).to(tl.float32)
    return last, staged, tl.where(last, row_ready(ok_ptr, row, stride_ok, K, KP), 0)


@triton.jit
def arrive_last(ok_ptr, arrive_ptr, row, chunk, ready, stride_ok, K: tl.constexpr):
    """Steps 1 (readiness; the caller stored its chunk) and 2 for program (row, chunk); →
    whether it is the row's last arrival (then the counter is back to 0)."""
    tl.store(ok_ptr + row * stride_ok + chunk, ready)
    return last_arrival(arrive_ptr + row, K)


@triton.jit
def row_ready(ok_ptr, row, stride_ok, K: tl.constexpr, KP: tl.constexpr):
    """The last arrival's readiness of the whole row: 1 iff every chunk was ready."""
    k = tl.arange(0, KP)
    ok = tl.load(ok_ptr + row * stride_ok + k, mask=k < K, other=1, volatile=True)
    return tl.min(ok, axis=0)
