"""Expert prefetch: predict a step's experts from the incoming hidden state of a sliding layer and
pull their gate/up weights (and scales) into L2 ahead of the MoE. A cache hint only: it writes
nothing but its own buffers (partials, ids, sink), which no other kernel reads. Twin:
reference/twins/prefetch.py `prefetch_experts_ref` (the predicted ids, exact).

Launches (grids fixed by R, m and the shapes, so one CUDA graph serves every n; n is read on the
device, and every program returns at once unless min_rows ≤ n ≤ max_rows):
  1. scores: grid (J, ⌈E/BE⌉). Program (j, b) sums hidden columns of chunk j one at a time, in
     ascending order, for all live rows and experts of block b → partials [J, R, E] FP32.
     Elementwise only (no tl.sum/tl.dot, whose orders are the compiler's), launched without FMA
     contraction, so the sums are the twin's bit for bit.
  2. select: grid (1,). score = partials added in chunk order, agg = live rows added in order,
     NaN → −inf, then m rounds of argmax (ties: lower index) → ids [M] int32.
  3. warm: grid (M, ⌈2I/BN⌉). Program (i, t) loads rows [t·BN, (t+1)·BN) of expert ids[i]'s fc
     bytes (E4M3 gate and up rows) with evict_last, program (i, 0) also its scale bytes, and
     stores their byte sum to sink[i, t] so the loads are not eliminated.
FMA note: with BF16 P the products are exact, so contraction could not change a bit anyway; FP32
P needs enable_fp_fusion=False (the interpreter never fuses).

Dimension letters: R rows (buffer), n live rows, H hidden, E experts, I expert intermediate,
M predicted experts, J = ⌈H/SCORE_CHUNK⌉ score chunks, BE experts per score program, BN fc rows
per warm program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import check_tensor, live_count
from kernels.fp8 import E4M3
from kernels.launch import launch_opts, pdl_enter
from kernels.twin import twin
from reference.params import FP8_BLOCK
from reference.twins import prefetch as _twins
from reference.twins.prefetch import SCORE_CHUNK

_COMPILE = dict(enable_fp_fusion=False)


@dataclass(frozen=True)
class PrefetchLaunch:
    block_e: int = 64  # experts per score program
    warm_block_n: int = 32  # fc rows per warm program
    warm_block_k: int = 128  # hidden columns per warm load
    scale_block: int = 128  # scale bytes per load
    num_warps: int = 4


def prefetch_launch(experts: int) -> PrefetchLaunch:
    """Pinned per shape (no autotuning). Not yet measured on the H200."""
    return PrefetchLaunch(block_e=min(64, triton.next_power_of_2(experts)))


@triton.jit
def _live(n_live_ptr, R, min_rows, max_rows):
    n = tl.minimum(tl.load(n_live_ptr), R)
    return n, (n >= min_rows) & (n <= max_rows)


@triton.jit
def _prefetch_scores_kernel(
    x_ptr, p_ptr, n_live_ptr, part_ptr, R, H, E, min_rows, max_rows,
    stride_xr, stride_ph, stride_pj, stride_pr,
    CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n, on = _live(n_live_ptr, R, min_rows, max_rows)
    if on == 0:
        return
    j = tl.program_id(0)
    rows = tl.arange(0, BLOCK_R)
    rm = rows < n
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    em = e < E
    acc = tl.zeros((BLOCK_R, BLOCK_E), dtype=tl.float32)
    for hh in range(0, CHUNK):  # ascending: the pinned order
        # columns past H load 0: acc + (+0.0) leaves acc's bits (acc is never −0.0)
        h = j * CHUNK + hh
        xv = tl.load(x_ptr + rows * stride_xr + h, mask=rm & (h < H), other=0.0).to(tl.float32)
        pv = tl.load(p_ptr + h * stride_ph + e, mask=em & (h < H), other=0.0).to(tl.float32)
        acc = acc + xv[:, None] * pv[None, :]  # [BR, BE]
    tl.store(part_ptr + j * stride_pj + rows[:, None] * stride_pr + e[None, :], acc,
             mask=rm[:, None] & em[None, :])


@triton.jit
def _prefetch_select_kernel(
    part_ptr, n_live_ptr, ids_ptr, R: tl.constexpr, E, J: tl.constexpr, M: tl.constexpr,
    min_rows, max_rows, stride_pj, stride_pr, BLOCK_EALL: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n, on = _live(n_live_ptr, R, min_rows, max_rows)
    if on == 0:
        return
    e = tl.arange(0, BLOCK_EALL)
    em = e < E
    agg = tl.zeros((BLOCK_EALL,), dtype=tl.float32)
    for r in range(0, R):  # rows ≥ n add +0.0, which leaves agg's bits (agg is never −0.0)
        lm = em & (r < n)
        s = tl.zeros((BLOCK_EALL,), dtype=tl.float32)
        for j in range(0, J):
            s = s + tl.load(part_ptr + j * stride_pj + r * stride_pr + e, mask=lm, other=0.0)
        agg = agg + s
    agg = tl.where(agg == agg, agg, float("-inf"))
    taken = e >= E  # padding experts count as already taken
    for i in range(0, M):
        best = tl.max(tl.where(taken, float("-inf"), agg), axis=0)
        idx = tl.min(tl.where((~taken) & (agg == best), e, BLOCK_EALL), axis=0)
        tl.store(ids_ptr + i, idx)
        taken = taken | (e == idx)


@triton.jit
def _prefetch_warm_kernel(
    ids_ptr, n_live_ptr, fc_ptr, fcs_ptr, sink_ptr, R, H: tl.constexpr, N2, E, SB: tl.constexpr,
    min_rows, max_rows,
    stride_fe, stride_fn, stride_fk, stride_se, stride_si,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n, on = _live(n_live_ptr, R, min_rows, max_rows)
    if on == 0:
        return
    i, t = tl.program_id(0), tl.program_id(1)
    ex = tl.load(ids_ptr + i)
    if (ex < 0) | (ex >= E):
        return
    rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < N2
    w_e = fc_ptr + ex.to(tl.int64) * stride_fe
    acc = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for k0 in range(0, H, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_e + rows[:, None] * stride_fn + c[None, :] * stride_fk,
                    mask=rm[:, None] & (c < H)[None, :], other=0,
                    eviction_policy="evict_last")  # [BN, BK] uint8
        acc += tl.sum(w.to(tl.int32), axis=1)
    total = tl.sum(acc, axis=0)
    if t == 0:
        for s0 in range(0, SB, BLOCK_S):
            b = s0 + tl.arange(0, BLOCK_S)
            sb = tl.load(fcs_ptr + ex.to(tl.int64) * stride_se + b, mask=b < SB, other=0,
                         eviction_policy="evict_last")
            total += tl.sum(sb.to(tl.int32), axis=0)
    tl.store(sink_ptr + i * stride_si + t, total)


@dataclass(frozen=True)
class PrefetchBuffers:
    """The prefetch's own outputs; valid only after a launch with min_rows ≤ n ≤ max_rows."""

    partials: torch.Tensor  # [J, R, E] fp32 score partials
    ids: torch.Tensor  # [M] int32 predicted experts
    sink: torch.Tensor  # [M, ⌈2I/BN⌉] int32 byte sums of the warmed tiles

    @classmethod
    def create(cls, rows: int, hidden: int, experts: int, two_i: int, m: int, device,
               config: PrefetchLaunch | None = None) -> PrefetchBuffers:
        cfg = config or prefetch_launch(experts)
        j = triton.cdiv(hidden, SCORE_CHUNK)
        return cls(torch.zeros(j, rows, experts, dtype=torch.float32, device=device),
                   torch.zeros(m, dtype=torch.int32, device=device),
                   torch.zeros(m, triton.cdiv(two_i, cfg.warm_block_n), dtype=torch.int32,
                               device=device))


@twin(_twins.prefetch_experts_ref)
def prefetch_experts(
    hidden: torch.Tensor,  # [R, H] bf16, unit column stride (padding rows may hold anything)
    n_live: torch.Tensor,  # device int32 [1]
    p: torch.Tensor,  # [H, E] bf16 / fp32 predictor, contiguous
    fc: torch.Tensor,  # [E, 2I, H] E4M3 gate/up weights
    fc_s: torch.Tensor,  # [E, ⌈2I/128⌉, ⌈H/128⌉] fp32 inverse scales, contiguous
    m: int,
    min_rows: int,
    max_rows: int,
    *,
    buffers: PrefetchBuffers | None = None,
    config: PrefetchLaunch | None = None,
    pdl: bool = False,
) -> PrefetchBuffers:
    """Predict m experts from the live rows of hidden and warm their gate/up bytes in L2 when
    min_rows ≤ n ≤ max_rows; otherwise every program returns at once and nothing is written.
    Never reads n on the host (CUDA-graph capturable for fixed shapes). pdl: programmatic
    dependent launch (kernels/launch.py), all three launches."""
    check_tensor("hidden", hidden, dims=2, dtypes=(torch.bfloat16,))
    dev = hidden.device
    r, h = hidden.shape
    if hidden.stride(1) != 1:
        raise ValueError(f"hidden: expected unit column stride, got strides {hidden.stride()}")
    n = live_count(n_live, r, dev)
    check_tensor("p", p, dims=2, dtypes=(torch.bfloat16, torch.float32), device=dev)
    e = p.shape[1]
    if p.shape[0] != h or not p.is_contiguous():
        raise ValueError(f"p: expected contiguous [{h}, E], got shape {tuple(p.shape)} "
                         f"strides {p.stride()}")
    check_tensor("fc", fc, dims=3, dtypes=(E4M3,), device=dev)
    if fc.shape[0] != e or fc.shape[2] != h:
        raise ValueError(f"fc: expected [{e}, 2I, {h}] (E from p), got {tuple(fc.shape)}")
    two_i = fc.shape[1]
    grid_s = (e, -(-two_i // FP8_BLOCK), -(-h // FP8_BLOCK))
    check_tensor("fc_s", fc_s, shape=grid_s, dtypes=(torch.float32,), device=dev)
    if not fc_s.is_contiguous():
        raise ValueError(f"fc_s: expected contiguous, got strides {fc_s.stride()}")
    if not isinstance(m, int) or not 1 <= m <= e:
        raise ValueError(f"m: expected an int in [1, num_experts={e}], got {m!r}")
    if not (isinstance(min_rows, int) and isinstance(max_rows, int) and 1 <= min_rows <= max_rows):
        raise ValueError(f"min_rows, max_rows: expected ints with 1 <= min_rows <= max_rows, "
                         f"got {min_rows!r}, {max_rows!r}")
    cfg = config or prefetch_launch(e)
    buf = buffers or PrefetchBuffers.create(r, h, e, two_i, m, dev, cfg)
    j = triton.cdiv(h, SCORE_CHUNK)
    tiles = triton.cdiv(two_i, cfg.warm_block_n)
    check_tensor("buffers.partials", buf.partials, shape=(j, r, e), dtypes=(torch.float32,),
                 device=dev)
    check_tensor("buffers.ids", buf.ids, shape=(m,), dtypes=(torch.int32,), device=dev)
    check_tensor("buffers.sink", buf.sink, shape=(m, tiles), dtypes=(torch.int32,), device=dev)
    if not (buf.partials.is_contiguous() and buf.sink.is_contiguous()):
        raise ValueError("buffers: partials and sink must be contiguous")
    _prefetch_scores_kernel[(j, triton.cdiv(e, cfg.block_e))](
        hidden, p, n, buf.partials, r, h, e, min_rows, max_rows,
        hidden.stride(0), p.stride(0), buf.partials.stride(0), buf.partials.stride(1),
        CHUNK=SCORE_CHUNK, BLOCK_R=triton.next_power_of_2(r), BLOCK_E=cfg.block_e,
        num_warps=cfg.num_warps, **launch_opts(pdl, **_COMPILE),
    )
    _prefetch_select_kernel[(1,)](
        buf.partials, n, buf.ids, r, e, j, m, min_rows, max_rows,
        buf.partials.stride(0), buf.partials.stride(1),
        BLOCK_EALL=triton.next_power_of_2(e), num_warps=cfg.num_warps,
        **launch_opts(pdl, **_COMPILE),
    )
    fc8 = fc.view(torch.uint8)  # the same bytes; integer sums need no FP8 support
    fs8 = fc_s.view(torch.uint8).reshape(e, -1)  # [E, SB] scale bytes per expert
    _prefetch_warm_kernel[(m, tiles)](
        buf.ids, n, fc8, fs8, buf.sink, r, h, two_i, e, fs8.shape[1], min_rows, max_rows,
        *fc8.stride(), fs8.stride(0), buf.sink.stride(0),
        BLOCK_N=cfg.warm_block_n, BLOCK_K=cfg.warm_block_k, BLOCK_S=cfg.scale_block,
        num_warps=cfg.num_warps, **launch_opts(pdl),
    )
    return buf
