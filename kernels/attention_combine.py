"""The combine of the split-KV attention (kernels/attention.py): merges the splits' FP32 O and
LSE in FP32 with four independent accumulation chains (split index mod 4, summed as
(c0 + c1) + (c2 + c3)), applies the sink through the LSE (O ← O·sigmoid(L − s),
s = scale·⟨q_h, sink_k[g]⟩), rounds once to the output dtype and, for the O projection, can
quantize its own output (whole 128-column groups per program). Padding rows are neither read
for results nor written.

Dimension letters as in kernels/attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_common import (
    LN2,
    LOG2E,
    Partials,
    interpreting,
    n_live_tensor,
    rne_bf16,
)
from kernels.fp8 import check_quantized, quantize_stored_groups
from kernels.launch import launch_opts, pdl_enter


@triton.jit
def _split_term(pl_ptr, o_base, s, S, s_ls, s_os, lse_off, hmask, mx, HB: tl.constexpr):
    """Split s's weight exp(lse_s − mx) [HB] and weighted output [HB, D]; 0 where no keys."""
    ok = hmask & ((s + tl.zeros([HB], tl.int32)) < S)
    lse = tl.load(pl_ptr + s * s_ls + lse_off, mask=ok, other=float("-inf"))
    has = lse > float("-inf")
    o = tl.load(o_base + s * s_os, mask=has[:, None], other=0.0)
    w = tl.exp2((lse - mx) * LOG2E)
    return w, o * w[:, None]


@triton.jit
def _combine_kernel(
    po_ptr, pl_ptr, q_ptr, sink_ptr, out_ptr, n_live_ptr, oq_ptr, os_ptr,
    HQ, scale,
    s_os, s_or, s_oh, s_ls, s_lr, s_qr, s_qh, s_sk, s_outr, s_outh, s_oqr, s_osr,
    G: tl.constexpr, D: tl.constexpr, S: tl.constexpr, BLOCK_S: tl.constexpr,
    HB: tl.constexpr, UNROLL: tl.constexpr, HAS_SINK: tl.constexpr, INTERPRET: tl.constexpr,
    QUANT: tl.constexpr, QGROUPS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    r = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)  # query heads of this program [HB]
    n_live = tl.load(n_live_ptr)
    hmask = (h < HQ) & ((r + tl.zeros([HB], tl.int32)) < n_live)
    d = tl.arange(0, D)
    sp = tl.arange(0, BLOCK_S)
    lse_off = r * s_lr + h
    lse_all = tl.load(pl_ptr + sp[:, None] * s_ls + lse_off[None, :],
                      mask=(sp < S)[:, None] & hmask[None, :], other=float("-inf"))  # [S, HB]
    mx = tl.max(lse_all, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    n_used = tl.max(tl.max(tl.where(lse_all > float("-inf"), sp[:, None] + 1, 0), axis=1), axis=0)
    o_base = po_ptr + r * s_or + h[:, None] * s_oh + d[None, :]
    acc0 = tl.zeros([HB, D], tl.float32)
    acc1 = tl.zeros([HB, D], tl.float32)
    acc2 = tl.zeros([HB, D], tl.float32)
    acc3 = tl.zeros([HB, D], tl.float32)
    den0 = tl.zeros([HB], tl.float32)
    den1 = tl.zeros([HB], tl.float32)
    den2 = tl.zeros([HB], tl.float32)
    den3 = tl.zeros([HB], tl.float32)
    s0 = 0
    while s0 < n_used:  # chain j takes the splits s ≡ j (mod 4), in increasing s
        # UNROLL groups of four per trip only batch the loads; each chain still adds its
        # splits one by one in increasing order, so the result does not depend on UNROLL
        for u in tl.static_range(UNROLL):
            s = s0 + 4 * u
            w0, x0 = _split_term(pl_ptr, o_base, s, S, s_ls, s_os, lse_off, hmask, mx, HB)
            w1, x1 = _split_term(pl_ptr, o_base, s + 1, S, s_ls, s_os, lse_off, hmask, mx, HB)
            w2, x2 = _split_term(pl_ptr, o_base, s + 2, S, s_ls, s_os, lse_off, hmask, mx, HB)
            w3, x3 = _split_term(pl_ptr, o_base, s + 3, S, s_ls, s_os, lse_off, hmask, mx, HB)
            acc0 += x0
            acc1 += x1
            acc2 += x2
            acc3 += x3
            den0 += w0
            den1 += w1
            den2 += w2
            den3 += w3
        s0 += 4 * UNROLL
    acc = (acc0 + acc1) + (acc2 + acc3)
    den = (den0 + den1) + (den2 + den3)
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
    tl.store(out_ptr + r * s_outr + h[:, None] * s_outh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    if QUANT:  # the O projection's operand: this program's HB·D columns (s_outh = D) are
        # whole 128-column groups
        quantize_stored_groups(out_ptr, oq_ptr, os_ptr, r, r < n_live,
                               tl.program_id(1) * (HB * D), HQ * D, s_outr, s_oqr, s_osr,
                               QGROUPS)


def attention_combine(
    parts: Partials,
    q: torch.Tensor,  # [R, Hq, D] (only read for the sink logit)
    sink_k: torch.Tensor | None,  # [Hkv, D]
    n_live,
    scale: float,
    out: torch.Tensor,  # [R, Hq, D]; rows >= n_live are not written
    *,
    heads_per_program: int = 1,
    unroll: int = 1,
    combine_warps: int = 4,
    quant_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """quant_out = (E4M3 [R, Hq·D], fp32 [R, ⌈Hq·D/128⌉]) to fill with quantize_act(out viewed
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
    oq, osc = _check_quant_out(quant_out, r, hq, d, hb, out)
    _combine_kernel[(r, triton.cdiv(hq, hb))](
        parts.o, parts.lse, q, sink, out, n_live_tensor(n_live, q.device), oq, osc, hq, scale,
        parts.o.stride(0), parts.o.stride(1), parts.o.stride(2),
        parts.lse.stride(0), parts.lse.stride(1), q.stride(0), q.stride(1),
        sink.stride(0), out.stride(0), out.stride(1), oq.stride(0), osc.stride(0),
        G=hq // hkv, D=d, S=s, BLOCK_S=triton.next_power_of_2(s), HB=hb, UNROLL=unroll,
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
