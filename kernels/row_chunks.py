"""A row's residual + RMSNorm spread over column-chunk programs inside one launch: each of K
programs of a row holds its chunk of the row's columns, and the last of them to arrive on a
per-row counter normalizes the whole row (used by the MoE tail, kernels/tails.py, with
TailLaunch.moe_chunk_groups).

Why: one program per row pulls the row's N rank partials through one SM (≈ 46 GB/s per SM on
the H100 at N = 24, reports/benchmarks/h100-2026-12-06b/); K chunk programs pull them through K
SMs. The norm needs the whole row's Σx², so every chunk program of a live row:

  1. stores its chunk of the residual x (bf16), its chunk's Σx² (FP64, `ss[row, chunk]`) and
     whether its partials were ready (`ok[row, chunk]`);
  2. arrives on `arrive[row]` (acq_rel, after a barrier: every thread's stores are issued);
  3. the program that sees K − 1 there — every other chunk's stores are visible to it — puts
     the counter back to 0, sums ss[row, 0..K) in FP64, rounds it to FP32 once, reloads the row's
     x (volatile: not from a cache that missed the others' stores) and does the norm, the stores
     and the quantization of the whole row.

A chunk whose partials never became ready arrives anyway, so the counter always completes; the
last arrival then writes the whole row as NaN (as one program per row does) and the scratch
keeps its invariant. Nobody waits on anybody, so the grid's order of execution does not matter (the
Triton interpreter runs the programs one after another).

Scratch invariant between launches: every counter 0 (`ss` needs none: it is written before it is
read in the same launch). Launches of one stream never overlap (with PDL the next launch waits
for this one's completion before its first load), so the next launch starts from it.

Bits: squares of bf16 values are exact in FP64, and a sum of ≤ 2^16 of them stays exact in FP64
while the squares span less than 2^37 in magnitude; the FP32 result is then the correctly
rounded Σx² whatever the chunking or reduction order, so every K ≥ 2 gives the same bits
(tests/kernels/test_row_chunks.py). One program per row (K = 1) keeps its FP32 sum: there an
FP64 reduction over the 4096-column row cost ≈ 5.8 µs more per launch on the H100.

Dimension letters: R rows, K chunks per row (KP: K rounded up to a power of two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_CHUNKS = 32  # chunk programs per row (a row of H ≤ 4096 in chunks of ≥ 128 columns)
MAX_ROWS = 64


@dataclass(frozen=True)
class RowChunkScratch:
    """The per-row arrival counters and chunk sums; made once per device, reused by every call
    (a captured graph replays it)."""

    arrive: torch.Tensor  # [MAX_ROWS] int32, 0 between launches
    ss: torch.Tensor  # [MAX_ROWS, MAX_CHUNKS] fp64: the current launch's chunk sums of squares
    ok: torch.Tensor  # [MAX_ROWS, MAX_CHUNKS] int32: the current launch's chunk readiness

    @classmethod
    def create(cls, device) -> RowChunkScratch:
        return cls(torch.zeros(MAX_ROWS, dtype=torch.int32, device=device),
                   torch.zeros(MAX_ROWS, MAX_CHUNKS, dtype=torch.float64, device=device),
                   torch.zeros(MAX_ROWS, MAX_CHUNKS, dtype=torch.int32, device=device))

    def reset(self) -> None:
        """After an aborted launch (device synchronized): every counter 0."""
        self.arrive.zero_()


@triton.jit
def sum_squares64(x):
    """Σ x² of a chunk held in registers [C] (masked columns hold 0), in FP64."""
    x64 = x.to(tl.float64)
    return tl.sum(x64 * x64, axis=0)


@triton.jit
def arrive_last(ss_ptr, ok_ptr, arrive_ptr, row, chunk, ss_chunk, ready, stride_ss,
                K: tl.constexpr):
    """Steps 1 (Σx² and readiness) and 2 for program (row, chunk); → whether it is the row's
    last arrival (then the counter is back to 0)."""
    tl.store(ss_ptr + row * stride_ss + chunk, ss_chunk)
    tl.store(ok_ptr + row * stride_ss + chunk, ready)
    tl.debug_barrier()  # release: every thread's stores are issued before the counter moves
    done = tl.atomic_add(arrive_ptr + row, 1, sem="acq_rel", scope="gpu")
    last = done == K - 1
    tl.store(arrive_ptr + row, 0, mask=last)
    return last


@triton.jit
def row_sum_squares(ss_ptr, ok_ptr, row, stride_ss, K: tl.constexpr, KP: tl.constexpr):
    """The last arrival's (FP32 Σx² of the row: the K chunk sums added in FP64 and rounded
    once, 1 when every chunk was ready else 0)."""
    k = tl.arange(0, KP)
    parts = tl.load(ss_ptr + row * stride_ss + k, mask=k < K, other=0.0, volatile=True)
    ok = tl.load(ok_ptr + row * stride_ss + k, mask=k < K, other=1, volatile=True)
    return tl.sum(parts, axis=0).to(tl.float32), tl.min(ok, axis=0)
