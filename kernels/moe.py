"""Block-FP8 MoE for 1–16 rows (target: 1–8 live rows of a decode round). Twin:
reference/fp8_ops.py `moe_fp8_ref` (stages `moe_gate_up_fp8_ref`, `moe_down_fp8_ref`).

Dimension letters: R rows in the padded buffer (≤ 16), n live rows (device scalar), H hidden,
E experts, K top-k, I expert intermediate, S = R·K slots (slot r·K + k is row r's k-th expert),
BN channels per program, BR = 16 rows on the MMA's narrow side.

Checkpoint layout: fc [E, 2I, H] E4M3 (rows [0, I) gate, [I, 2I) up), fc_scale_inv
[E, ⌈2I/128⌉, ⌈H/128⌉]; proj [E, H, I], proj_scale_inv [E, ⌈H/128⌉, ⌈I/128⌉]. Scale blocks may
straddle the gate/up boundary (I = 192 per TP8 rank) and be partial (I = 64): every weight row
looks up its own block row, n // 128.

Launches (all grids fixed by R, so one CUDA graph serves every n ≤ R; n is read on the device):
  1. act-quant x → E4M3 + scales per row per 128 columns           (kernels/fp8.py)
  2. gate/up: grid (S, ⌈I/BN⌉). Program (s, t) leads slot s's expert e unless an earlier live
     slot routes to e too, so each distinct expert is read once; it computes tile t of
     SiLU(gate)·up for every live row routed to e and writes it, FP32, to each such slot.
  3. act-quant of the FP32 intermediate per slot per 128 columns (same kernel as 1). The
     128-column quantization groups span several gate/up tiles, so the amax is only known once
     all tiles are written; quantizing here keeps the intermediate exact in FP32 in between.
  4. down: grid (S, ⌈H/BN⌉), same expert dedup; writes each slot's FP32 expert output [H].
  5. combine: grid (R, ⌈H/BH⌉): out[r] = Σ_k w[r, k] · y[r·K + k], FP32 in k order, one rounding.
The weight tile is the MMA's wide side (BN × 128) and the ≤ 16 rows its narrow side, so the
programs stream weights while rows ride along; slots and tiles spread the work over all SMs.
E4M3 tiles are widened to FP16 (exact) before tl.dot: Hopper's FP8 MMA accumulates with reduced
precision (≈14 bits, DeepSeek-V3 report §3.3.2; Triton's sm_90 default allows it for all of K),
while FP16 MMA accumulates in FP32. The kernels are memory-bound, so the widening is free and the
GEMMs stay at FP32 accuracy; each 128-wide K block is then scaled and added in FP32.
Rows ≥ n and their slots are never read or written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8 import E4M3, bf16_rne, check_quantized, check_tensor, live_count, quantize_act
from kernels.launch import launch_opts, pdl_enter
from reference.params import FP8_BLOCK

BLOCK_R = 16  # rows on the narrow side of the MMA (tl.dot needs >= 16)


@dataclass(frozen=True)
class MoeLaunch:
    gate_up_block_n: int  # intermediate channels per gate/up program (each of gate and up)
    down_block_n: int  # hidden channels per down program
    combine_block_h: int  # hidden channels per combine program
    num_warps: int = 4
    gate_up_stages: int = 6  # deep pipeline: at 1 row only ~96 gate/up programs stream H
    down_stages: int = 2  # down's K loop is only ⌈I/128⌉ = 2 blocks long

    def __post_init__(self) -> None:
        for name in ("gate_up_block_n", "down_block_n", "combine_block_h"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoeLaunch.{name}: expected a power of two >= 16, got {v}")


def moe_launch(hidden: int, inter: int) -> MoeLaunch:
    """Pinned: a pure function of the shape, no autotuning. Chosen on the H200 by
    benchmarks/sweep_moe.py (reports/benchmarks/h200-2026-11-29/sweep_moe.log): per TP8 rank
    (H 3072, I 192) 32-channel gate/up tiles with a 3-stage pipeline and 128-channel down tiles
    were fastest at 1 and 6 rows (38.0 / 50.8 µs vs 40.5 / 58.6 µs for 16 / 6 / 64)."""
    return MoeLaunch(
        gate_up_block_n=32,
        down_block_n=128,
        combine_block_h=min(512, max(16, triton.next_power_of_2(hidden))),
        gate_up_stages=3,
    )


# --- kernels ---------------------------------------------------------------------------------


@triton.jit
def _expert_rows(ids_ptr, n_live, stride_ir, stride_ik,
                 K: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """For slot s = program_id(0): its expert e; lead = s is live and no earlier slot routes to e
    (earlier slots of live rows are live); hit [BR, K_PAD] = live row r's k-th slot routes to e."""
    s = tl.program_id(0)
    live = s // K < n_live
    e = tl.load(ids_ptr + (s // K) * stride_ir + (s % K) * stride_ik, mask=live, other=-1)
    prev = tl.arange(0, S_PAD)
    pe = tl.load(ids_ptr + (prev // K) * stride_ir + (prev % K) * stride_ik, mask=prev < s,
                 other=-1)
    lead = live & (tl.sum((pe == e).to(tl.int32), axis=0) == 0)
    rows = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, K_PAD)
    valid = (rows[:, None] < n_live) & (ks[None, :] < K)  # [BR, K_PAD]
    rid = tl.load(ids_ptr + rows[:, None] * stride_ir + ks[None, :] * stride_ik, mask=valid,
                  other=-1)
    return e, lead, (rid == e) & valid


@triton.jit
def _moe_gate_up_kernel(
    xq_ptr, xs_ptr, ids_ptr, n_live_ptr, fc_ptr, fcs_ptr, a_ptr,
    R, H: tl.constexpr, I: tl.constexpr,
    stride_xqr, stride_xsr, stride_ir, stride_ik,
    stride_fe, stride_fn, stride_fk, stride_se, stride_sn, stride_sk, stride_ar,
    K: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n_live = tl.minimum(tl.load(n_live_ptr), R)
    e, lead, hit = _expert_rows(ids_ptr, n_live, stride_ir, stride_ik, K, K_PAD, S_PAD, BLOCK_R)
    if lead == 0:
        return
    rows = tl.arange(0, BLOCK_R)  # [BR]
    uses = tl.max(hit.to(tl.int32), axis=1) > 0  # [BR] rows routed to e
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] intermediate channels
    cm = c < I
    w_e = fc_ptr + e.to(tl.int64) * stride_fe
    s_e = fcs_ptr + e.to(tl.int64) * stride_se
    acc_g = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, H, 128):
        hc = k0 + tl.arange(0, 128)  # [128] hidden columns of this scale block
        km = hc < H
        xq = tl.load(xq_ptr + rows[None, :] * stride_xqr + hc[:, None],
                     mask=km[:, None] & uses[None, :], other=0.0)  # [128, BR] E4M3
        xs = tl.load(xs_ptr + rows * stride_xsr + k0 // 128, mask=uses, other=0.0)  # [BR]
        wm = cm[:, None] & km[None, :]
        wg = tl.load(w_e + c[:, None] * stride_fn + hc[None, :] * stride_fk, mask=wm, other=0.0)
        wu = tl.load(w_e + (I + c)[:, None] * stride_fn + hc[None, :] * stride_fk, mask=wm,
                     other=0.0)  # [BN, 128] E4M3
        sg = tl.load(s_e + (c // 128) * stride_sn + (k0 // 128) * stride_sk, mask=cm, other=0.0)
        su = tl.load(s_e + ((I + c) // 128) * stride_sn + (k0 // 128) * stride_sk, mask=cm,
                     other=0.0)  # [BN]
        xh = xq.to(tl.float16)
        acc_g += tl.dot(wg.to(tl.float16), xh) * (sg[:, None] * xs[None, :])
        acc_u += tl.dot(wu.to(tl.float16), xh) * (su[:, None] * xs[None, :])
    a = tl.div_rn(acc_g, 1.0 + tl.exp(-acc_g)) * acc_u  # [BN, BR] SiLU(gate)·up, FP32
    # every slot (r, k) routed to e gets the row's tile: [BN, BR, K_PAD]
    slot = rows[:, None] * K + tl.arange(0, K_PAD)[None, :]  # [BR, K_PAD]
    tl.store(a_ptr + slot[None, :, :] * stride_ar + c[:, None, None], a[:, :, None],
             mask=cm[:, None, None] & hit[None, :, :])


@triton.jit
def _moe_down_kernel(
    aq_ptr, as_ptr, ids_ptr, n_live_ptr, proj_ptr, ps_ptr, y_ptr,
    R, H: tl.constexpr, I: tl.constexpr,
    stride_aqr, stride_asr, stride_ir, stride_ik,
    stride_pe, stride_pn, stride_pk, stride_se, stride_sn, stride_sk, stride_yr,
    K: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n_live = tl.minimum(tl.load(n_live_ptr), R)
    e, lead, hit = _expert_rows(ids_ptr, n_live, stride_ir, stride_ik, K, K_PAD, S_PAD, BLOCK_R)
    if lead == 0:
        return
    rows = tl.arange(0, BLOCK_R)  # [BR]
    slot = rows[:, None] * K + tl.arange(0, K_PAD)[None, :]  # [BR, K_PAD]
    # one slot of row r routed to e (all of them hold the same intermediate), −1 if none
    src = tl.max(tl.where(hit, slot, -1), axis=1)  # [BR]
    uses = src >= 0
    h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden channels
    hm = h < H
    w_e = proj_ptr + e.to(tl.int64) * stride_pe
    s_e = ps_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for i0 in range(0, I, 128):
        ii = i0 + tl.arange(0, 128)
        im = ii < I
        aq = tl.load(aq_ptr + src[None, :] * stride_aqr + ii[:, None],
                     mask=im[:, None] & uses[None, :], other=0.0)  # [128, BR] E4M3
        sa = tl.load(as_ptr + src * stride_asr + i0 // 128, mask=uses, other=0.0)  # [BR]
        w = tl.load(w_e + h[:, None] * stride_pn + ii[None, :] * stride_pk,
                    mask=hm[:, None] & im[None, :], other=0.0)  # [BN, 128] E4M3
        sw = tl.load(s_e + (h // 128) * stride_sn + (i0 // 128) * stride_sk, mask=hm, other=0.0)
        acc += tl.dot(w.to(tl.float16), aq.to(tl.float16)) * (sw[:, None] * sa[None, :])
    tl.store(y_ptr + slot[None, :, :] * stride_yr + h[:, None, None], acc[:, :, None],
             mask=hm[:, None, None] & hit[None, :, :])


@triton.jit
def _moe_combine_kernel(
    y_ptr, w_ptr, n_live_ptr, out_ptr, H,
    stride_yr, stride_wr, stride_wk, stride_or,
    K: tl.constexpr, BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    r = tl.program_id(0)
    if r >= tl.load(n_live_ptr):
        return
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for kk in tl.static_range(K):  # pinned order: k = 0, 1, …, K−1
        w = tl.load(w_ptr + r * stride_wr + kk * stride_wk)
        acc = acc + w * tl.load(y_ptr + (r * K + kk) * stride_yr + h, mask=hm, other=0.0)
    if OUT_BF16:
        tl.store(out_ptr + r * stride_or + h, bf16_rne(acc), mask=hm)
    else:
        tl.store(out_ptr + r * stride_or + h, acc, mask=hm)


# --- wrappers ----------------------------------------------------------------------------------


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def _check_routing(x_rows: int, ids: torch.Tensor, device, weights=None) -> int:
    check_tensor("ids", ids, dims=2, dtypes=(torch.int32, torch.int64), device=device)
    if ids.shape[0] != x_rows:
        raise ValueError(f"ids: expected {x_rows} rows (the row buffer), got {tuple(ids.shape)}")
    k = ids.shape[1]
    if not 1 <= k <= 16:
        raise ValueError(f"ids: top-k must be in [1, 16], got {k}")
    if weights is not None:
        check_tensor("weights", weights, shape=(x_rows, k), dtypes=(torch.float32,), device=device)
    return k


def _check_experts(name: str, w, s, rows_out: int | None, cols: int | None, device):
    check_tensor(name, w, dims=3, dtypes=(E4M3,), device=device)
    e, n, c = w.shape
    if rows_out is not None and n != rows_out:
        raise ValueError(f"{name}: expected dim 1 = {rows_out}, got shape {tuple(w.shape)}")
    if cols is not None and c != cols:
        raise ValueError(f"{name}: expected dim 2 = {cols}, got shape {tuple(w.shape)}")
    check_tensor(f"{name}_scale_inv", s, shape=(e, _blocks(n), _blocks(c)),
                 dtypes=(torch.float32,), device=device)


def _check_rows(r: int) -> None:
    if not 1 <= r <= BLOCK_R:
        raise ValueError(f"row buffer: expected 1..{BLOCK_R} rows, got {r}")


def moe_gate_up_fp8(
    x: torch.Tensor,  # [R, H] bf16 / fp16 / fp32 (padding rows may hold anything)
    ids: torch.Tensor,  # [R, K] int32 / int64, distinct within a row, in [0, E)
    fc: torch.Tensor,  # [E, 2I, H] E4M3
    fc_scale_inv: torch.Tensor,  # [E, ⌈2I/128⌉, ⌈H/128⌉] fp32
    n_live: torch.Tensor | None = None,  # device int32 [1]; None = all R rows
    *,
    out: torch.Tensor | None = None,  # [R·K, I] fp32, unit column stride
    config: MoeLaunch | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,  # quantize_act(x) made earlier
    pdl: bool = False,
) -> torch.Tensor:
    """Stage 1: SiLU(gate)·up per slot, FP32 [R·K, I]; slots of rows ≥ n untouched. quantized =
    (xq [R, H] E4M3, xs [R, ⌈H/128⌉] fp32), unit column strides, equal to quantize_act(x) on the
    live rows (kernels/tails.py attn_tail made it): no quantization launch.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    check_tensor("x", x, dims=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    r, hidden = x.shape
    _check_rows(r)
    dev = x.device
    k = _check_routing(r, ids, dev)
    _check_experts("fc", fc, fc_scale_inv, None, hidden, dev)
    if fc.shape[1] % 2:
        raise ValueError(f"fc: dim 1 must be 2·I (gate rows then up rows), got {fc.shape[1]}")
    inter = fc.shape[1] // 2
    n = live_count(n_live, r, dev)
    if out is None:
        out = torch.empty(r * k, inter, dtype=torch.float32, device=dev)
    check_tensor("out", out, shape=(r * k, inter), dtypes=(torch.float32,), device=dev)
    if out.stride(1) != 1:
        raise ValueError(f"out: expected unit column stride, got strides {out.stride()}")
    cfg = config or moe_launch(hidden, inter)
    if quantized is None:
        xq, xs = quantize_act(x, n, pdl=pdl)
    else:
        xq, xs = check_quantized("quantized", quantized, r, hidden, dev)
    grid = (r * k, triton.cdiv(inter, cfg.gate_up_block_n))
    _moe_gate_up_kernel[grid](
        xq, xs, ids, n, fc, fc_scale_inv, out, r, hidden, inter,
        xq.stride(0), xs.stride(0), ids.stride(0), ids.stride(1),
        *fc.stride(), *fc_scale_inv.stride(), out.stride(0),
        K=k, K_PAD=triton.next_power_of_2(k), S_PAD=max(16, triton.next_power_of_2(r * k)),
        BLOCK_N=cfg.gate_up_block_n,
        BLOCK_R=BLOCK_R, num_warps=cfg.num_warps, num_stages=cfg.gate_up_stages,
        **launch_opts(pdl),
    )
    return out


def moe_down_fp8(
    a: torch.Tensor,  # [R·K, I] fp32 from moe_gate_up_fp8
    weights: torch.Tensor,  # [R, K] fp32 router weights
    ids: torch.Tensor,  # [R, K]
    proj: torch.Tensor,  # [E, H, I] E4M3
    proj_scale_inv: torch.Tensor,  # [E, ⌈H/128⌉, ⌈I/128⌉] fp32
    n_live: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,  # [R, H] out_dtype, unit column stride
    out_dtype: torch.dtype = torch.bfloat16,
    config: MoeLaunch | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Stage 2: requantize a per slot per 128 columns, down GEMM, k-ordered weighted sum → [R, H]
    (bf16 by default, or fp32); rows ≥ n untouched.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    dev = weights.device
    check_tensor("weights", weights, dims=2, dtypes=(torch.float32,), device=dev)
    r = weights.shape[0]
    _check_rows(r)
    k = _check_routing(r, ids, dev, weights)
    check_tensor("a", a, dims=2, dtypes=(torch.float32,), device=dev)
    _check_experts("proj", proj, proj_scale_inv, None, a.shape[1], dev)
    if a.shape[0] != r * k:
        raise ValueError(f"a: expected {r * k} slot rows (R·K), got shape {tuple(a.shape)}")
    hidden, inter = proj.shape[1], proj.shape[2]
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    n = live_count(n_live, r, dev)
    if out is None:
        out = torch.empty(r, hidden, dtype=out_dtype, device=dev)
    check_tensor("out", out, shape=(r, hidden), dtypes=(out_dtype,), device=dev)
    if out.stride(1) != 1:
        raise ValueError(f"out: expected unit column stride, got strides {out.stride()}")
    cfg = config or moe_launch(hidden, inter)
    aq, sa = quantize_act(a, n, rows_per_live=k, pdl=pdl)
    y = torch.empty(r * k, hidden, dtype=torch.float32, device=dev)  # [S, H] per-slot outputs
    s_pad = max(16, triton.next_power_of_2(r * k))
    _moe_down_kernel[(r * k, triton.cdiv(hidden, cfg.down_block_n))](
        aq, sa, ids, n, proj, proj_scale_inv, y, r, hidden, inter,
        aq.stride(0), sa.stride(0), ids.stride(0), ids.stride(1),
        *proj.stride(), *proj_scale_inv.stride(), y.stride(0),
        K=k, K_PAD=triton.next_power_of_2(k), S_PAD=s_pad, BLOCK_N=cfg.down_block_n,
        BLOCK_R=BLOCK_R,
        num_warps=cfg.num_warps, num_stages=cfg.down_stages, **launch_opts(pdl),
    )
    _moe_combine_kernel[(r, triton.cdiv(hidden, cfg.combine_block_h))](
        y, weights, n, out, hidden, y.stride(0), weights.stride(0), weights.stride(1),
        out.stride(0), K=k, BLOCK_H=cfg.combine_block_h, OUT_BF16=out_dtype == torch.bfloat16,
        num_warps=cfg.num_warps, **launch_opts(pdl),
    )
    return out


def moe_fp8(
    x: torch.Tensor,  # [R, H] expert input (normalized hidden), R ≤ 16
    weights: torch.Tensor,  # [R, K] fp32 router weights
    ids: torch.Tensor,  # [R, K] expert ids, distinct within a row, in [0, E)
    fc: torch.Tensor,  # [E, 2I, H] E4M3
    fc_scale_inv: torch.Tensor,  # [E, ⌈2I/128⌉, ⌈H/128⌉] fp32
    proj: torch.Tensor,  # [E, H, I] E4M3
    proj_scale_inv: torch.Tensor,  # [E, ⌈H/128⌉, ⌈I/128⌉] fp32
    n_live: torch.Tensor | None = None,  # device int32 [1]; None = all R rows
    *,
    out: torch.Tensor | None = None,  # [R, H] out_dtype
    out_dtype: torch.dtype = torch.bfloat16,
    config: MoeLaunch | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,  # see moe_gate_up_fp8
    pdl: bool = False,
) -> torch.Tensor:
    """Σ_k weights[r, k] · expert_{ids[r, k]}(x_r) for live rows r < n → [R, H] (bf16 default).

    n_live is never read on the host, so the call is CUDA-graph capturable for a fixed R. Rows ≥ n
    of x, weights, ids are never read and of out never written. ids must be valid expert indices
    (checked by the router, not here: checking device values would need a host sync).
    pdl: programmatic dependent launch (kernels/launch.py).
    """
    check_tensor("x", x, dims=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    if proj.dim() == 3 and proj.shape[1] != x.shape[1]:
        raise ValueError(f"proj: expected dim 1 = hidden {x.shape[1]}, got {tuple(proj.shape)}")
    n = live_count(n_live, x.shape[0], x.device)
    a = moe_gate_up_fp8(x, ids, fc, fc_scale_inv, n, config=config, quantized=quantized,
                        pdl=pdl)
    return moe_down_fp8(a, weights, ids, proj, proj_scale_inv, n, out=out, out_dtype=out_dtype,
                        config=config, pdl=pdl)
