"""Dense projections y = x · Wᵀ for a buffer of ≤ 16 rows (≤ 8 live in a decode round).
Twins: reference/twins/linear.py (`linear_fp8_ref`, `linear_fp8_partials_ref`,
`linear_bf16_f32_ref`, `reduce_splits_ref`).

Dimension letters: R rows in the buffer, n live rows (device int32 [1]), N output channels,
K input columns, Kb = ⌈K/BK⌉ column blocks, S split-K count, BN channels per program,
BR = 16 rows on the MMA's narrow side.

  linear_fp8       block FP8: E4M3 W [N, K] with FP32 inverse scales [⌈N/128⌉, ⌈K/128⌉]; x is
                   quantized per row per 128 columns by kernels.fp8.quantize_act (one launch
                   before the GEMM, bit-exact with reference.ops.quantize_act) — QKV, O, dense
                   layer-0 gate/up/down, a quantized lm_head
  linear_bf16_f32  BF16 W [N, K], FP32 product — lm_head (FP32 logits), eh_proj (bf16 out)

Work split (memory-bound: a few FLOP per weight byte): the weight tile [BN, BK] is the MMA's
wide side and the rows its narrow side. Grid (⌈N/BN⌉, S): program (t, s) streams channel tile t
over column blocks [s·KB, (s+1)·KB) and writes FP32 partials [S, R, N] — or, when S = 1, the
output itself. Split-K exists so that all 132 SMs stream weights (QKV has only 16 tiles of 64
channels). Partials are summed by `_reduce_splits_kernel`, or by a consumer (kernels/qk_rope,
the residual tails) in the same pinned order s = 0, 1, …, S−1; nothing uses atomics, so every
run gives the same bits.

FP8 block step: acc += dot(W_blk, xq_blkᵀ) · (sw · sx). Both E4M3 tiles are widened to FP16
(exact) before tl.dot: Hopper's FP8 MMA accumulates with ≈14-bit precision (see kernels/moe.py),
FP16 MMA in FP32, and the widening is free in a memory-bound kernel.
K is a constexpr on purpose: when K is a known multiple of the K step, the column masks are
uniform per 16-byte vector and Triton pipelines the weight loads with cp.async (num_stages);
with a runtime K the sm_90 PTX has plain per-element loads and no pipelining.
The Triton interpreter multiplies bf16 bit patterns in tl.dot; under it (INTERPRET) the BF16
kernel widens both tiles to FP32 first — bf16·bf16 products are exact in FP32 either way.
Rows ≥ n are never read (masked loads) and never written.
Launch configuration (tiles, split-K, pinned per-rank shapes): kernels/linear_launch.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.checks import check_quantized, check_tensor, live_count
from kernels.fp8 import E4M3, bf16_rne, blocks, quantize_act
from kernels.launch import launch_opts, pdl_enter, prefetch_l2
from kernels.linear_launch import LinearLaunch, linear_bf16_launch, linear_fp8_launch, split_plan
from kernels.twin import twin
from reference.params import FP8_BLOCK
from reference.twins import linear as _twins

BLOCK_R = 16  # rows on the narrow side of the MMA (tl.dot needs ≥ 16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --- kernels ---------------------------------------------------------------------------------


@triton.jit
def _store_tile(out_ptr, acc, rows, live, c, cm, stride_or, stride_on, OUT_BF16: tl.constexpr):
    """acc [BN, BR] → out[r, c] for live rows r and channels c < N (bf16 RNE or fp32)."""
    ptrs = out_ptr + rows[None, :] * stride_or + c[:, None] * stride_on
    mask = cm[:, None] & live[None, :]
    if OUT_BF16:
        tl.store(ptrs, bf16_rne(acc), mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _linear_fp8_kernel(
    xq_ptr, sx_ptr, w_ptr, ws_ptr, n_live_ptr, out_ptr,
    R, N,
    stride_xr, stride_sxr, stride_wn, stride_wk, stride_sn, stride_sk,
    stride_os, stride_or, stride_on,
    K: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    OUT_BF16: tl.constexpr, HOIST: tl.constexpr, EARLY: tl.constexpr, PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """x arrives quantized (kernels.fp8.quantize_act, one launch before this one): quantizing
    inside the K loop made every program redo ~2k IEEE divisions per 128-column block, which
    left the H200 run at 5-8% of HBM bandwidth (reports/benchmarks/h200-2026-11-29)."""
    if PREFETCH:  # before the PDL wait: the weights are no predecessor's output
        prefetch_weights(w_ptr, N, K, stride_wn, stride_wk, KB, BLOCK_N)
    pdl_enter(PDL)
    fp8_program(xq_ptr, sx_ptr, w_ptr, ws_ptr, n_live_ptr, out_ptr, R, N, stride_xr, stride_sxr,
                stride_wn, stride_wk, stride_sn, stride_sk, stride_os, stride_or, stride_on, K,
                KB, BLOCK_N, BLOCK_R, OUT_BF16, HOIST, EARLY)


@triton.jit
def prefetch_weights(w_ptr, N, K: tl.constexpr, stride_wn, stride_wk, KB: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """Program (tile, split)'s weight slice [BN, KB·128] E4M3 into L2 (LinearLaunch.prefetch_w):
    one 128-byte line per channel and 128-column block (a whole line when the row is
    contiguous)."""
    c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    bs = tl.arange(0, triton.next_power_of_2(KB))  # [KBP]
    k0 = (tl.program_id(1) * KB + bs) * 128  # first column of each block
    mask = (c < N)[:, None] & ((bs < KB) & (k0 < K))[None, :]  # [BN, KBP]
    prefetch_l2(w_ptr + c.to(tl.int64)[:, None] * stride_wn + k0[None, :] * stride_wk, mask,
                w_ptr)


@triton.jit
def fp8_program(xq_ptr, sx_ptr, w_ptr, ws_ptr, n_live_ptr, out_ptr, R, N, stride_xr,
                stride_sxr, stride_wn, stride_wk, stride_sn, stride_sk, stride_os, stride_or,
                stride_on, K: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_R: tl.constexpr, OUT_BF16: tl.constexpr, HOIST: tl.constexpr = False,
                EARLY: tl.constexpr = False):
    """Program (tile, split) = program ids (0, 1): channels tile·BN … over column blocks
    [split·KB, (split+1)·KB), its [BN, BR] product stored into out[split] → (rows [BR], the
    live row count) (kernels/qk_rope.py's folded QKV launch runs it too).
    HOIST (LinearLaunch.hoist_scales): the split's row and weight scales are loaded before the
    K loop and picked per block inside it (one-hot sums of positive scales: exact), so the
    pipelined loop waits only on the cp.async tiles of x and w — loaded inside it, each scale
    is a synchronous round trip after each wait. The same values in the same operations: the
    same bits.
    EARLY (LinearLaunch.early_loads): x and its scales are read for all R rows of the buffer
    (valid memory; a padding row's bytes reach only its own output column, never stored), so
    no load waits for n_live: without it every tile load is issued after n_live's round trip
    (sm_90 code: the first cp.async after the first wait on n_live's load). Live rows: the
    same bits."""
    n_live = tl.minimum(tl.load(n_live_ptr), R)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_R)  # [BR]
    live = rows < n_live
    read = rows < R if EARLY else live  # [BR] the rows x and its scales are loaded for
    c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output channels
    cm = c < N
    w_rows = w_ptr + c.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    if HOIST:
        bs = tl.arange(0, triton.next_power_of_2(KB))  # [KBP] blocks of this split
        kbs = split * KB + bs
        bv = (bs < KB) & (kbs * 128 < K)
        sx_all = tl.load(sx_ptr + rows[:, None] * stride_sxr + kbs[None, :],
                         mask=read[:, None] & bv[None, :], other=0.0)  # [BR, KBP]
        sw_all = tl.load(ws_ptr + (c // 128)[None, :] * stride_sn + kbs[:, None] * stride_sk,
                         mask=bv[:, None] & cm[None, :], other=0.0)  # [KBP, BN]
    for i in range(KB):  # block kb of this split; past the last block every load is masked (0)
        kb = split * KB + i
        kk = kb * 128 + tl.arange(0, 128)  # [128] columns of scale block kb
        km = kk < K
        xq = tl.load(xq_ptr + rows[:, None] * stride_xr + kk[None, :],
                     mask=read[:, None] & km[None, :], other=0.0)  # [BR, 128] E4M3
        w = tl.load(w_rows + kk[None, :] * stride_wk, mask=cm[:, None] & km[None, :],
                    other=0.0)  # [BN, 128] E4M3
        if HOIST:
            sx = tl.sum(tl.where((bs == i)[None, :], sx_all, 0.0), axis=1)  # [BR]
            sw = tl.sum(tl.where((bs == i)[:, None], sw_all, 0.0), axis=0)  # [BN]
        else:
            sx = tl.load(sx_ptr + rows * stride_sxr + kb, mask=read & (kb * 128 < K),
                         other=0.0)  # [BR]
            sw = tl.load(ws_ptr + (c // 128) * stride_sn + kb * stride_sk,
                         mask=cm & (kb * 128 < K), other=0.0)  # [BN]: each channel's block row
        part = tl.dot(w.to(tl.float16), tl.trans(xq.to(tl.float16)))  # [BN, BR]
        acc += part * (sw[:, None] * sx[None, :])
    _store_tile(out_ptr + split * stride_os, acc, rows, live, c, cm, stride_or, stride_on,
                OUT_BF16)
    return rows, n_live


@triton.jit
def _linear_bf16_kernel(
    x_ptr, w_ptr, n_live_ptr, out_ptr,
    R, N,
    stride_xr, stride_xk, stride_wn, stride_wk,
    stride_os, stride_or, stride_on,
    K: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n_live = tl.minimum(tl.load(n_live_ptr), R)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_R)
    live = rows < n_live
    c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cm = c < N
    w_rows = w_ptr + c.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for i in range(KB):
        kk = (split * KB + i) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        km = kk < K
        xt = tl.load(x_ptr + rows[None, :] * stride_xr + kk[:, None] * stride_xk,
                     mask=km[:, None] & live[None, :], other=0.0)  # [BK, BR] bf16
        w = tl.load(w_rows + kk[None, :] * stride_wk, mask=cm[:, None] & km[None, :],
                    other=0.0)  # [BN, BK] bf16
        acc = dot_bf16(acc, w, xt, INTERPRET)
    _store_tile(out_ptr + split * stride_os, acc, rows, live, c, cm, stride_or, stride_on,
                OUT_BF16)


@triton.jit
def dot_bf16(acc, w, xt, INTERPRET: tl.constexpr):
    """acc [BN, BR] + w [BN, BK] · xt [BK, BR] for bf16 tiles, FP32 products (see the module
    docstring for the interpreter's FP32 operands)."""
    if INTERPRET:
        return acc + tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(w, xt)


@triton.jit
def _reduce_splits_kernel(
    p_ptr, n_live_ptr, out_ptr, R, N,
    stride_ps, stride_pr, stride_or, stride_on,
    S: tl.constexpr, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    r = tl.program_id(0)
    if r >= tl.minimum(tl.load(n_live_ptr), R):
        return
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < N
    acc = tl.load(p_ptr + r * stride_pr + c, mask=cm, other=0.0)
    for s in tl.static_range(1, S):  # pinned order: ((p0 + p1) + p2) + …
        acc += tl.load(p_ptr + s * stride_ps + r * stride_pr + c, mask=cm, other=0.0)
    if OUT_BF16:
        tl.store(out_ptr + r * stride_or + c * stride_on, bf16_rne(acc), mask=cm)
    else:
        tl.store(out_ptr + r * stride_or + c * stride_on, acc, mask=cm)


# --- wrappers ----------------------------------------------------------------------------------

_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _check_x(x: torch.Tensor, dtypes) -> tuple[int, int]:
    check_tensor("x", x, dims=2, dtypes=dtypes)
    r, k = x.shape
    if not 1 <= r <= BLOCK_R:
        raise ValueError(f"x: expected 1..{BLOCK_R} rows (the row buffer), got {r}")
    if k < 1:
        raise ValueError(f"x: expected at least one column, got shape {tuple(x.shape)}")
    return r, k


def _check_weight(name: str, w: torch.Tensor, dtypes, k: int, device) -> int:
    check_tensor(name, w, dims=2, dtypes=dtypes, device=device)
    if w.shape[1] != k:
        raise ValueError(f"{name}: expected {k} columns (x has K = {k}), got {tuple(w.shape)}")
    if w.shape[0] < 1:
        raise ValueError(f"{name}: expected at least one row, got shape {tuple(w.shape)}")
    return w.shape[0]


def _check_out(name: str, t, shape, dtype, device) -> None:
    check_tensor(name, t, shape=shape, dtypes=(dtype,), device=device)
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride in the last dim, got {t.stride()}")


def _partials_buffer(partials, s: int, r: int, n: int, device) -> torch.Tensor:
    if partials is None:
        return torch.empty(s, r, n, dtype=torch.float32, device=device)
    _check_out("partials", partials, (s, r, n), torch.float32, device)
    return partials


def _finish(partials, n_live, out, s, r, n, out_dtype, cfg: LinearLaunch, *,
            pdl: bool = False) -> torch.Tensor:
    _reduce_splits_kernel[(r, triton.cdiv(n, cfg.reduce_block))](
        partials, n_live, out, r, n, partials.stride(0), partials.stride(1), *out.stride(),
        S=s, BLOCK=cfg.reduce_block, OUT_BF16=out_dtype == torch.bfloat16, num_warps=4,
        **launch_opts(pdl),
    )
    return out


def check_prefetch(cfg: LinearLaunch, pdl: bool) -> None:
    """LinearLaunch.prefetch_w works only ahead of a PDL wait: refuse it without."""
    if cfg.prefetch_w and not pdl:
        raise ValueError("LinearLaunch.prefetch_w: prefetches the weights before the PDL wait; "
                         "needs pdl=True (programmatic dependent launch)")


def _launch_fp8(x, weight, scale_inv, n, dst, s, kb, out_bf16, cfg, quantized=None, *,
                pdl=False):
    check_prefetch(cfg, pdl)
    r, k = x.shape
    big_n = weight.shape[0]
    # [R, K] E4M3, [R, ⌈K/128⌉] fp32; rows ≥ n untouched
    xq, sx = quantize_act(x, n, pdl=pdl) if quantized is None else quantized
    stride_os = dst.stride(0) if dst.dim() == 3 else 0
    _linear_fp8_kernel[(triton.cdiv(big_n, cfg.block_n), s)](
        xq, sx, weight, scale_inv, n, dst, r, big_n, xq.stride(0), sx.stride(0),
        *weight.stride(), *scale_inv.stride(), stride_os, dst.stride(-2), dst.stride(-1),
        K=k, KB=kb, BLOCK_N=cfg.block_n, BLOCK_R=BLOCK_R, OUT_BF16=out_bf16,
        HOIST=cfg.hoist_scales, EARLY=cfg.early_loads, PREFETCH=cfg.prefetch_w,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_opts(pdl),
    )


def _check_fp8_args(x, weight, scale_inv, config):
    r, k = _check_x(x, (torch.bfloat16, torch.float16, torch.float32))
    big_n = _check_weight("weight", weight, (E4M3,), k, x.device)
    nb, kb = blocks(big_n), blocks(k)
    check_tensor("scale_inv", scale_inv, shape=(nb, kb), dtypes=(torch.float32,),
                 device=x.device)
    cfg = config or linear_fp8_launch(big_n, k)
    if cfg.block_k != FP8_BLOCK:
        raise ValueError(f"config.block_k: the FP8 kernel steps one {FP8_BLOCK}-column scale "
                         f"block at a time, got {cfg.block_k}")
    return r, k, big_n, cfg, split_plan(kb, cfg.split_k)


def linear_fp8_splits(n: int, k: int, config: LinearLaunch | None = None) -> int:
    """S, the leading dim of linear_fp8_partials' output for an [N, K] weight."""
    cfg = config or linear_fp8_launch(n, k)
    return split_plan(blocks(k), cfg.split_k)[0]


@twin(_twins.linear_fp8_partials_ref)
def linear_fp8_partials(
    x: torch.Tensor,  # [R, K] bf16 / fp16 / fp32, any strides; rows ≥ n may hold anything
    weight: torch.Tensor,  # [N, K] E4M3, any strides
    scale_inv: torch.Tensor,  # [⌈N/128⌉, ⌈K/128⌉] fp32 inverse block scales
    n_live: torch.Tensor | None = None,  # device int32 [1]; None = all R rows
    *,
    out: torch.Tensor | None = None,  # [S, R, N] fp32, unit stride in N
    config: LinearLaunch | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,  # quantize_act(x) made earlier
    pdl: bool = False,
) -> torch.Tensor:
    """Split-K partial products [S, R, N] FP32 (S = linear_fp8_splits(K, config)); the consumer
    sums them in the order s = 0, 1, …, S−1. Rows ≥ n untouched. quantized = (xq [R, K] E4M3
    with unit column stride, sx [R, ⌈K/128⌉] fp32) must equal quantize_act(x) on the live rows
    (a producer that quantized x already, kernels/tails.py moe_tail): no quantization launch.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    r, k, big_n, cfg, (s, kb) = _check_fp8_args(x, weight, scale_inv, config)
    n = live_count(n_live, r, x.device)
    if quantized is not None:
        quantized = check_quantized("quantized", quantized, r, k, x.device)
    out = _partials_buffer(out, s, r, big_n, x.device)
    _launch_fp8(x, weight, scale_inv, n, out, s, kb, False, cfg, quantized, pdl=pdl)
    return out


@twin(_twins.linear_fp8_ref)
def linear_fp8(
    x: torch.Tensor,  # [R, K] bf16 / fp16 / fp32, any strides; rows ≥ n may hold anything
    weight: torch.Tensor,  # [N, K] E4M3, any strides
    scale_inv: torch.Tensor,  # [⌈N/128⌉, ⌈K/128⌉] fp32
    n_live: torch.Tensor | None = None,  # device int32 [1]; None = all R rows
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,  # [R, N] out_dtype, unit stride in N
    partials: torch.Tensor | None = None,  # [S, R, N] fp32 workspace when S > 1
    config: LinearLaunch | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """y = quantize_act(x) · dequant(W)ᵀ → [R, N] (bf16 RNE or fp32), rows ≥ n untouched.

    n_live is never read on the host: the call is CUDA-graph capturable for a fixed R.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    r, k, big_n, cfg, (s, kb) = _check_fp8_args(x, weight, scale_inv, config)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    n = live_count(n_live, r, x.device)
    if out is None:
        out = torch.empty(r, big_n, dtype=out_dtype, device=x.device)
    _check_out("out", out, (r, big_n), out_dtype, x.device)
    if s == 1:
        _launch_fp8(x, weight, scale_inv, n, out, 1, kb, out_dtype == torch.bfloat16, cfg,
                    pdl=pdl)
        return out
    partials = _partials_buffer(partials, s, r, big_n, x.device)
    _launch_fp8(x, weight, scale_inv, n, partials, s, kb, False, cfg, pdl=pdl)
    return _finish(partials, n, out, s, r, big_n, out_dtype, cfg, pdl=pdl)


@twin(_twins.linear_bf16_f32_ref)
def linear_bf16_f32(
    x: torch.Tensor,  # [R, K] bf16, any strides; rows ≥ n may hold anything
    weight: torch.Tensor,  # [N, K] bf16 (lm_head [V, H], eh_proj [H, 2H]), any strides
    n_live: torch.Tensor | None = None,  # device int32 [1]; None = all R rows
    *,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,  # [R, N] out_dtype, unit stride in N
    partials: torch.Tensor | None = None,  # [S, R, N] fp32 workspace when S > 1
    config: LinearLaunch | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """y = x · Wᵀ with an FP32 product → [R, N] FP32 (logits) or bf16 RNE; rows ≥ n untouched.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    r, k = _check_x(x, (torch.bfloat16,))
    big_n = _check_weight("weight", weight, (torch.bfloat16,), k, x.device)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    cfg = config or linear_bf16_launch(big_n, k)
    s, kb = split_plan(-(-k // cfg.block_k), cfg.split_k)
    n = live_count(n_live, r, x.device)
    if out is None:
        out = torch.empty(r, big_n, dtype=out_dtype, device=x.device)
    _check_out("out", out, (r, big_n), out_dtype, x.device)
    dst = out if s == 1 else _partials_buffer(partials, s, r, big_n, x.device)
    _linear_bf16_kernel[(triton.cdiv(big_n, cfg.block_n), s)](
        x, weight, n, dst, r, big_n, *x.stride(), *weight.stride(),
        dst.stride(0) if s > 1 else 0, dst.stride(-2), dst.stride(-1),
        K=k, KB=kb, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=BLOCK_R,
        OUT_BF16=s == 1 and out_dtype == torch.bfloat16, INTERPRET=_interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_opts(pdl),
    )
    if s == 1:
        return out
    return _finish(dst, n, out, s, r, big_n, out_dtype, cfg, pdl=pdl)
