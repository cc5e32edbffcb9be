"""Block FP8 (E4M3) kernels: dynamic activation quantization (per row, per 128 columns) and
128×128 weight dequantization. Twins: reference/twins/fp8.py (`quantize_act_ref`,
`dequant_block_ref`); both kernels are bit-exact with them.

Dimension letters: R rows, C quantized columns, Gc = ⌈C/128⌉ column groups, B batch (experts),
N weight rows, K weight columns.

Rounding is done by hand. The Triton interpreter's own E4M3 and BF16 downcasts are not
round-to-nearest-even (measured: 46 of 4096 random fp32→E4M3 casts land a binade low because the
mantissa carry is OR-ed into the exponent; fp32→BF16 truncates), so values are first snapped onto
the target grid with IEEE fp32 operations and integer bit arithmetic. The final `.to()` is then
exact on every backend (interpreter, sm_90 `cvt.rn.satfinite`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import check_tensor, live_count
from kernels.launch import launch_opts, pdl_enter
from kernels.twin import twin
from reference.params import FP8_BLOCK
from reference.twins import fp8 as _twins

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


# --- shared @triton.jit helpers (also used by kernels/moe.py) ------------------------------


@triton.jit
def e4m3_rne(y):
    """fp32 y with |y| ≤ 448 → the nearest E4M3 value (ties to even), as fp32, sign kept."""
    bits = y.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    mag = bits & 2147483647
    # |y| ≥ 2^-6 (normal E4M3): keep 3 of the 23 mantissa bits; the integer add carries into
    # the exponent when the mantissa rounds up past 1.111b.
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576
    # |y| < 2^-6 (subnormal E4M3): fixed quantum 2^-9, the fp32 ulp in [2^14, 2^15), so the IEEE
    # add rounds to nearest even on that grid and the subtraction is exact.
    a = mag.to(tl.float32, bitcast=True)
    sub = ((a + 16384.0) - 16384.0).to(tl.int32, bitcast=True)
    r = tl.where(mag >= 0x3C800000, normal, sub)
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def bf16_rne(x):
    """fp32 → bf16, round to nearest even (the interpreter's own cast truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return r.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def quantize_groups(x):
    """x fp32 [G, 128] (masked columns already 0) → (E4M3 [G, 128], fp32 scales [G]).

    Same operations as reference.ops.quantize_act: scale = amax / 448 (1 for an all-zero
    group), q = RNE(clamp(x / scale, ±448)); both divisions IEEE-rounded (`/` may be approximate
    on the GPU).
    """
    return _quantize_along(x, 1)


@triton.jit
def quantize_cols(x):
    """x fp32 [128, C]: one 128-value group per column (the transposed layout of an MMA operand)
    → (E4M3 [128, C], fp32 scales [C]); the same operations as quantize_groups."""
    return _quantize_along(x, 0)


@triton.jit
def _quantize_along(x, AXIS: tl.constexpr):
    """Groups of 128 along AXIS of a 2-D x; see quantize_groups."""
    amax = tl.max(tl.abs(x), axis=AXIS)
    scale = tl.where(amax > 0.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    y = tl.div_rn(x, tl.broadcast_to(tl.expand_dims(scale, AXIS), x.shape))
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return e4m3_rne(y).to(tl.float8e4nv), scale


@triton.jit
def quantize_row(x, q_ptr, s_ptr, row, live, cols, stride_qr, stride_sr, GROUPS: tl.constexpr):
    """quantize_act of one row held in registers: x fp32 [GROUPS·128] → q [cols] E4M3 and
    scales [⌈cols/128⌉] stored at `row`. The values quantized are exactly those the caller
    stored (it passes the rounded row), so no store → barrier → reload: the MoE tail's
    quantization took 3.6 µs that way on the H200 at 6 rows
    (reports/benchmarks/h200-2026-12-01/session9/exp_quant_call9.log); the tails and the
    attention combine all quantize from registers."""
    grp = tl.arange(0, GROUPS)
    col = grp[:, None] * 128 + tl.arange(0, 128)[None, :]  # [G, 128]
    # columns ≥ cols and padding rows as 0 (never stored; a padding row holds NaN: no evidence)
    qm = (col < cols) & live
    q, s = quantize_groups(tl.where(qm, tl.reshape(x, [GROUPS, 128]), 0.0))
    tl.store(q_ptr + row * stride_qr + col, q, mask=qm)
    tl.store(s_ptr + row * stride_sr + grp, s, mask=(grp * 128 < cols) & live)


# --- kernels ---------------------------------------------------------------------------------


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, n_live_ptr,
    C, stride_xr, stride_xc, stride_qr, stride_sr,
    ROWS_PER_LIVE: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    # Rows at or beyond n_live · ROWS_PER_LIVE are neither read nor written.
    if row >= tl.load(n_live_ptr) * ROWS_PER_LIVE:
        return
    grp = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [G]
    col = grp[:, None] * 128 + tl.arange(0, 128)[None, :]  # [G, 128]
    mask = col < C
    x = tl.load(x_ptr + row * stride_xr + col * stride_xc, mask=mask, other=0.0)
    q, s = quantize_groups(x.to(tl.float32))
    tl.store(q_ptr + row * stride_qr + col, q, mask=mask)
    tl.store(s_ptr + row * stride_sr + grp, s, mask=grp * 128 < C)


@triton.jit
def _dequant_block_kernel(
    w_ptr, s_ptr, out_ptr, N, K,
    stride_wb, stride_wn, stride_wk, stride_sb, stride_sn, stride_sk, stride_ob, stride_on,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(2).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    mask = (n[:, None] < N) & (k[None, :] < K)
    w = tl.load(w_ptr + b * stride_wb + n[:, None] * stride_wn + k[None, :] * stride_wk, mask=mask)
    s = tl.load(
        s_ptr + b * stride_sb + (n // 128)[:, None] * stride_sn + (k // 128)[None, :] * stride_sk,
        mask=mask,
    )
    # E4M3FN has no infinities; S.1111.111 is NaN (the interpreter's upcast would read 480)
    nan = (w.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
    wf = tl.where(nan, float("nan"), w.to(tl.float32))
    tl.store(out_ptr + b * stride_ob + n[:, None] * stride_on + k[None, :], wf * s, mask=mask)


# --- launch configurations (pinned per shape; no autotuning: these paths are bit-exact) ------


@dataclass(frozen=True)
class ActQuantLaunch:
    groups: int  # 128-column groups per program (power of two)
    num_warps: int


@dataclass(frozen=True)
class DequantLaunch:
    block_n: int
    block_k: int
    num_warps: int


def act_quant_launch(cols: int) -> ActQuantLaunch:
    """One program per row and up to 8 groups (1024 columns): 3 programs per row at C = 3072."""
    return ActQuantLaunch(groups=min(8, triton.next_power_of_2(blocks(cols))), num_warps=4)


def dequant_launch(rows: int, cols: int) -> DequantLaunch:
    return DequantLaunch(block_n=64, block_k=128, num_warps=4)


# --- wrappers ----------------------------------------------------------------------------------


def blocks(n: int) -> int:
    """128-column FP8 blocks covering n columns."""
    return -(-n // FP8_BLOCK)


@twin(_twins.quantize_act_ref)
def quantize_act(
    x: torch.Tensor,  # [R, C] bf16 / fp16 / fp32, any strides
    n_live: torch.Tensor | None = None,  # device int32 [1]; None = all rows
    *,
    rows_per_live: int = 1,
    q_out: torch.Tensor | None = None,  # [R, C] E4M3, contiguous rows
    scale_out: torch.Tensor | None = None,  # [R, Gc] fp32
    config: ActQuantLaunch | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic E4M3 quantization per row per 128 columns → (q [R, C], scales [R, Gc]).

    Only rows < n_live · rows_per_live are read and written; the rest of q_out / scale_out is left
    as it was (uninitialized when allocated here). Bit-exact with reference.ops.quantize_act.
    pdl: programmatic dependent launch (kernels/launch.py).
    """
    check_tensor("x", x, dims=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    r, c = x.shape
    if c < 1:
        raise ValueError(f"x: expected at least one column, got shape {tuple(x.shape)}")
    if rows_per_live < 1:
        raise ValueError(f"rows_per_live: expected >= 1, got {rows_per_live}")
    n = live_count(n_live, -(-r // rows_per_live), x.device)
    gc = blocks(c)
    if q_out is None:
        q_out = torch.empty(r, c, dtype=E4M3, device=x.device)
    check_tensor("q_out", q_out, shape=(r, c), dtypes=(E4M3,), device=x.device)
    if q_out.stride(1) != 1:
        raise ValueError(f"q_out: expected unit column stride, got strides {q_out.stride()}")
    if scale_out is None:
        scale_out = torch.empty(r, gc, dtype=torch.float32, device=x.device)
    check_tensor("scale_out", scale_out, shape=(r, gc), dtypes=(torch.float32,), device=x.device)
    if scale_out.stride(1) != 1:
        raise ValueError(f"scale_out: expected unit column stride, got {scale_out.stride()}")
    if r == 0:
        return q_out, scale_out
    cfg = config or act_quant_launch(c)
    grid = (r, triton.cdiv(gc, cfg.groups))
    _act_quant_kernel[grid](
        x, q_out, scale_out, n, c, x.stride(0), x.stride(1), q_out.stride(0), scale_out.stride(0),
        ROWS_PER_LIVE=rows_per_live, GROUPS=cfg.groups, num_warps=cfg.num_warps,
        **launch_opts(pdl),
    )
    return q_out, scale_out


@twin(_twins.dequant_block_ref)
def dequant_block(
    w: torch.Tensor,  # [..., N, K] E4M3
    scale_inv: torch.Tensor,  # [..., ⌈N/128⌉, ⌈K/128⌉] fp32
    *,
    out: torch.Tensor | None = None,  # [..., N, K] fp32, contiguous
    config: DequantLaunch | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """E4M3 weights × FP32 inverse block scales → FP32 [..., N, K]; bit-exact with
    reference.ops.dequant_block (one fp32 multiply per element).
    pdl: programmatic dependent launch (kernels/launch.py)."""
    check_tensor("w", w, dtypes=(E4M3,))
    if w.dim() < 2:
        raise ValueError(f"w: expected [..., N, K], got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    check_tensor("scale_inv", scale_inv, shape=(*lead, blocks(n), blocks(k)),
                 dtypes=(torch.float32,), device=w.device)
    if out is None:
        out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    check_tensor("out", out, shape=w.shape, dtypes=(torch.float32,), device=w.device)
    if not out.is_contiguous():
        raise ValueError("out: expected a contiguous tensor")
    if w.numel() == 0:
        return out
    w3, o3 = w.reshape(-1, n, k), out.view(-1, n, k)
    s3 = scale_inv.reshape(-1, *scale_inv.shape[-2:])
    if w3.shape[0] > 65535:
        raise ValueError(f"w: at most 65535 leading matrices, got {w3.shape[0]}")
    cfg = config or dequant_launch(n, k)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k), w3.shape[0])
    _dequant_block_kernel[grid](
        w3, s3, o3, n, k, *w3.stride(), *s3.stride(), o3.stride(0), o3.stride(1),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        **launch_opts(pdl),
    )
    return out
