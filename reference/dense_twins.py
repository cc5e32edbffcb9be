"""Matched-precision twins of the dense kernels (kernels/linear.py, kernels/qk_rope.py), built
from reference/ops.py in plain torch on the CPU. Each twin takes the kernel's arguments and rounds
at exactly the kernel's rounding points; what remains between the two is FP32 accumulation order
inside the GEMMs (none at all for qk_rope).

Dimension letters: R rows in the buffer, n live rows, N output channels, K input columns,
S split-K partials, Hq / Hkv query / KV heads, D head dim.
Twins return live rows only ([n, …] / [S, n, …]); the kernels leave padding rows untouched.
"""

from __future__ import annotations

import torch

from reference import ops
from reference.params import FP8_BLOCK


def _n_live(n_live, rows: int) -> int:
    if n_live is None:
        return rows
    return min(rows, int(torch.as_tensor(n_live).reshape(-1)[0].item()))


def _dequant(weight, scale_inv):
    return ops.dequant_block(weight.cpu(), scale_inv.cpu())


def _fp8_operands(x, weight, scale_inv, n: int, dequant=_dequant):
    """x's live rows quantized per row per 128 columns and dequantized [n, K]; W dequantized
    [N, K] — both FP32, exactly the values the kernel's MMA and scale multiply represent.
    dequant: a memoizing stand-in may be passed (iquestrt/ops.py TwinOps)."""
    xd = ops.dequant_act(*ops.quantize_act(x[:n].cpu()))
    return xd, dequant(weight, scale_inv)


def linear_fp8_ref(x, weight, scale_inv, n_live=None, *, out_dtype=torch.bfloat16,
                   dequant=_dequant):
    """Twin of kernels.linear.linear_fp8 → [n, N]: one FP32 GEMM on the dequantized operands,
    rounded once to out_dtype."""
    n = _n_live(n_live, x.shape[0])
    xd, wd = _fp8_operands(x, weight, scale_inv, n, dequant)
    return ops.round_to(ops.gemm(xd, wd), out_dtype)


def linear_fp8_partials_ref(x, weight, scale_inv, n_live=None, *, splits: int):
    """Twin of kernels.linear.linear_fp8_partials → [S, n, N] FP32, S = splits: split s covers
    128-column blocks [s·KB, (s+1)·KB) with KB = ⌈Kb/S⌉ (the kernel's split_plan)."""
    n = _n_live(n_live, x.shape[0])
    xd, wd = _fp8_operands(x, weight, scale_inv, n)
    k_blocks = -(-x.shape[1] // FP8_BLOCK)
    kb = -(-k_blocks // splits)
    if -(-k_blocks // kb) != splits:
        raise ValueError(f"splits: {splits} is not a split count of {k_blocks} column blocks")
    cols = kb * FP8_BLOCK
    return torch.stack([ops.gemm(xd[:, s * cols : (s + 1) * cols],
                                 wd[:, s * cols : (s + 1) * cols]).float() for s in range(splits)])


def reduce_splits_ref(partials: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """[S, n, N] FP32 → [n, N]: ((p0 + p1) + p2) + …, the kernels' pinned order, one rounding."""
    acc = partials[0].float().cpu()
    for s in range(1, partials.shape[0]):
        acc = acc + partials[s].float().cpu()
    return acc.to(out_dtype)


def linear_bf16_f32_ref(x, weight, n_live=None, *, out_dtype=torch.float32):
    """Twin of kernels.linear.linear_bf16_f32 → [n, N]: ops.linear with an FP32 product."""
    n = _n_live(n_live, x.shape[0])
    return ops.linear(x[:n].cpu(), weight.cpu(), out_dtype=out_dtype)


def head_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.rms_norm over the head dim, bf16 out, with the sum of squares accumulated in FP64 and
    rounded once to FP32: bf16 squares are exact, so this sum does not depend on reduction order
    and the kernel's parallel reduction reproduces it (an FP32 sum would not). The rest is
    ops.rms_norm's FP32 sequence, rsqrt written as the correctly rounded 1 / sqrt."""
    xf = x.float()
    mean = (xf.double() ** 2).sum(-1, keepdim=True).float() / x.shape[-1]
    return (xf * (1.0 / torch.sqrt(mean + eps)) * weight.float()).to(torch.bfloat16)


def qk_rope_ref(
    qkv, q_norm_weight, k_norm_weight, positions, table, n_live=None, *,
    num_q_heads: int, num_kv_heads: int, eps: float,
):
    """Twin of kernels.qk_rope.qk_rope → (q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D]) bf16.

    qkv [R, W] bf16 or [S, R, W] FP32 partials (reduced as reduce_splits_ref, rounded to bf16).
    RoPE is ops.rope itself (cos / sin of position + table.offset recomputed from table.theta,
    not read from the table);
    rows whose position is outside the table's [0, P) get NaN q and k, as in the kernel."""
    n = _n_live(n_live, qkv.shape[-2])
    flat = reduce_splits_ref(qkv[:, :n]) if qkv.dim() == 3 else qkv[:n].cpu().to(torch.bfloat16)
    d = flat.shape[1] // (num_q_heads + 2 * num_kv_heads)
    q_w, kv_w = num_q_heads * d, num_kv_heads * d
    q = flat[:, :q_w].reshape(n, num_q_heads, d)
    k = flat[:, q_w : q_w + kv_w].reshape(n, num_kv_heads, d)
    v = flat[:, q_w + kv_w :].reshape(n, num_kv_heads, d)
    if q_norm_weight is not None:
        q = head_rms_norm_ref(q, q_norm_weight.cpu(), eps)
        k = head_rms_norm_ref(k, k_norm_weight.cpu(), eps)
    pos = positions[:n].cpu().long()
    bad = (pos < 0) | (pos >= table.positions)
    q = ops.rope(q, pos.clamp(min=0) + table.offset, table.rotary_dim, table.theta)
    k = ops.rope(k, pos.clamp(min=0) + table.offset, table.rotary_dim, table.theta)
    q[bad], k[bad] = float("nan"), float("nan")
    return q, k, v.clone()
