"""The combine of the split-KV attention (kernels/attention/): merges the splits' FP32 O and
LSE in FP32 in trips of SB consecutive splits up to the last split with keys (one [SB, HB, D]
load per trip, summed over the trip by tl.sum, trips added in increasing split order: the bits
depend on the launch — SB and the warps' reduction tree — which the pinned config fixes, not on
timing), applies the sink through the LSE (O ← O·sigmoid(L − s), s = scale·⟨q_h, sink_k[g]⟩),
rounds once to the output dtype and, for the O projection, can quantize its own output (whole
128-column groups per program, from registers). Padding rows are neither read for results nor
written.

Dimension letters as in kernels/attention/.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.common import (
    LN2,
    LOG2E,
    Partials,
    interpreting,
    n_live_tensor,
    rne_bf16,
)
from kernels.checks import check_quantized
from kernels.fp8 import quantize_row
from kernels.launch import launch_opts, pdl_enter


@triton.jit
def _combine_kernel(
    po_ptr, pl_ptr, q_ptr, sink_ptr, out_ptr, n_live_ptr, oq_ptr, os_ptr,
    HQ, scale,
    s_os, s_or, s_oh, s_ls, s_lr, s_qr, s_qh, s_sk, s_outr, s_outh, s_oqr, s_osr,
    G: tl.constexpr, D: tl.constexpr, S: tl.constexpr, BLOCK_S: tl.constexpr,
    HB: tl.constexpr, SB: tl.constexpr, HAS_SINK: tl.constexpr, INTERPRET: tl.constexpr,
    QUANT: tl.constexpr, QGROUPS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    r = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)  # query heads of this program [HB]
    n_live = tl.load(n_live_ptr)
    d = tl.arange(0, D)
    sp = tl.arange(0, BLOCK_S)
    lse_off = r * s_lr + h
    # not masked by n_live, so this load does not wait for it (a padding row reads its stale
    # LSEs, finds n_used = 0 below and stores nothing)
    lse_all = tl.load(pl_ptr + sp[:, None] * s_ls + lse_off[None, :],
                      mask=(sp < S)[:, None] & (h < HQ)[None, :], other=float("-inf"))  # [S, HB]
    hmask = (h < HQ) & ((r + tl.zeros([HB], tl.int32)) < n_live)
    lse_all = tl.where(hmask[None, :], lse_all, float("-inf"))
    mx = tl.max(lse_all, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    n_used = tl.max(tl.max(tl.where(lse_all > float("-inf"), sp[:, None] + 1, 0), axis=1), axis=0)
    o_base = po_ptr + r * s_or + h[:, None] * s_oh + d[None, :]  # [HB, D]
    sb = tl.arange(0, SB)
    acc = tl.zeros([HB, D], tl.float32)
    den = tl.zeros([HB], tl.float32)
    s0 = 0
    while s0 < n_used:
        s = s0 + sb  # [SB]
        ok = (s < n_used)[:, None] & hmask[None, :]
        # O and LSE of the trip load together: a split without keys for this row (its O never
        # written) weighs 0 and the where() drops whatever its O holds
        lse = tl.load(pl_ptr + s[:, None] * s_ls + lse_off[None, :], mask=ok,
                      other=float("-inf"))  # [SB, HB]
        o = tl.load(o_base[None, :, :] + s[:, None, None] * s_os, mask=ok[:, :, None],
                    other=0.0)  # [SB, HB, D]
        w = tl.exp2((lse - mx[None, :]) * LOG2E)
        acc += tl.sum(tl.where(w[:, :, None] > 0.0, o, 0.0) * w[:, :, None], axis=0)
        den += tl.sum(w, axis=0)
        s0 += SB
    den = tl.where(den > 0.0, den, 1.0)
    o = acc / den[:, None]
    if HAS_SINK:
        # sigmoid(L − s) with L = mx + ln(den), s = scale · ⟨q_h, sink_k[h // G]⟩ (natural log)
        qv = tl.load(q_ptr + r * s_qr + h[:, None] * s_qh + d[None, :], mask=hmask[:, None],
                     other=0.0).to(tl.float32)
        sk = tl.load(sink_ptr + (h // G)[:, None] * s_sk + d[None, :], mask=hmask[:, None],
                     other=0.0).to(tl.float32)
        s_logit = tl.sum(qv * sk, axis=1) * scale
        z = mx + tl.log2(den) * LN2 - s_logit  # L − s
        e = tl.exp2(-tl.abs(z) * LOG2E)  # no overflow for any z
        o = o * tl.where(z >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))[:, None]
    if INTERPRET:
        if out_ptr.dtype.element_ty == tl.bfloat16:
            o = rne_bf16(o)
    o = o.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * s_outr + h[:, None] * s_outh + d[None, :], o, mask=hmask[:, None])
    if QUANT:  # the O projection's operand, from the values just stored: this program's HB·D
        # columns (s_outh = D) are whole 128-column groups
        col0 = tl.program_id(1) * (HB * D)
        quantize_row(tl.reshape(o.to(tl.float32), [HB * D]), oq_ptr + col0, os_ptr + col0 // 128,
                     r, r < n_live, HQ * D - col0, s_oqr, s_osr, QGROUPS)


def attention_combine(
    parts: Partials,
    q: torch.Tensor,  # [R, Hq, D] (only read for the sink logit)
    sink_k: torch.Tensor | None,  # [Hkv, D]
    n_live,
    scale: float,
    out: torch.Tensor,  # [R, Hq, D]; rows >= n_live are not written
    *,
    heads_per_program: int = 1,
    splits_per_trip: int = 4,
    combine_warps: int = 4,
    quant_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """splits_per_trip: SB above (a power of two).

    quant_out = (E4M3 [R, Hq·D], fp32 [R, ⌈Hq·D/128⌉]) to fill with quantize_act(out viewed
    [R, Hq·D]) on the live rows, bit for bit (the O projection's operand); needs
    combine_quantizes(...) and out's heads contiguous. pdl: programmatic dependent launch
    (kernels/launch.py)."""
    s, r, hq, d = parts.o.shape
    if tuple(out.shape) != (r, hq, d) or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"attention_combine: out must be [{r}, {hq}, {d}] on {q.device}, last "
                         f"dim contiguous; got {tuple(out.shape)} on {out.device}")
    hkv = hq if sink_k is None else sink_k.shape[0]
    if sink_k is not None and (sink_k.dim() != 2 or sink_k.shape[1] != d or hq % hkv
                               or sink_k.stride(-1) != 1 or sink_k.device != q.device):
        raise ValueError(f"attention_combine: sink_k must be [Hkv, {d}] with {hq} % Hkv == 0 "
                         f"on {q.device}, got {tuple(sink_k.shape)} on {sink_k.device}")
    sink = sink_k if sink_k is not None else q  # placeholder pointer, never read
    hb = min(heads_per_program, triton.next_power_of_2(hq))
    if splits_per_trip < 1 or splits_per_trip & (splits_per_trip - 1):
        raise ValueError(f"attention_combine: splits_per_trip must be a power of two >= 1, got "
                         f"{splits_per_trip}")
    oq, osc = _check_quant_out(quant_out, r, hq, d, hb, out)
    _combine_kernel[(r, triton.cdiv(hq, hb))](
        parts.o, parts.lse, q, sink, out, n_live_tensor(n_live, q.device), oq, osc, hq, scale,
        parts.o.stride(0), parts.o.stride(1), parts.o.stride(2),
        parts.lse.stride(0), parts.lse.stride(1), q.stride(0), q.stride(1),
        sink.stride(0), out.stride(0), out.stride(1), oq.stride(0), osc.stride(0),
        G=hq // hkv, D=d, S=s, BLOCK_S=triton.next_power_of_2(s), HB=hb, SB=splits_per_trip,
        HAS_SINK=sink_k is not None, INTERPRET=interpreting(),
        QUANT=quant_out is not None, QGROUPS=max(1, hb * d // 128), num_warps=combine_warps,
        **launch_opts(pdl),
    )
    return out


def combine_quantizes(hq: int, d: int, heads_per_program: int) -> bool:
    """Whether the combine can quantize its output itself: each program's heads cover whole
    128-column groups (D a power of two, HB·D a multiple of 128)."""
    hb = min(heads_per_program, triton.next_power_of_2(hq))
    return d & (d - 1) == 0 and (hb * d) % 128 == 0


def _check_quant_out(quant_out, r: int, hq: int, d: int, hb: int, out: torch.Tensor):
    if quant_out is None:
        return out, out  # placeholders, never touched (QUANT off)
    if not combine_quantizes(hq, d, hb) or out.stride(1) != d:
        raise ValueError(f"attention_combine: quant_out needs whole 128-column groups per "
                         f"program (heads {hb} × D {d}) and contiguous heads in out")
    oq, osc = check_quantized("attention_combine: quant_out", quant_out, r, hq * d, out.device)
    return oq, osc
