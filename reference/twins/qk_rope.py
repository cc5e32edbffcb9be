"""Twin of kernels/qk_rope.py: the QKV split, per-head RMS norm of q and k, and RoPE —
no accumulation order is left between the two (the norms are over one head's D values, summed
in the kernel's order).

Dimension letters: R rows in the buffer, n live rows, S split-K partials, Hq / Hkv query / KV
heads, D head dim.
"""

from __future__ import annotations

import torch

from reference import ops
from reference.twins.kv_cache import write_ref
from reference.twins.linear import _n_live, linear_fp8_partials_ref, reduce_splits_ref


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
    num_q_heads: int, num_kv_heads: int, eps: float, cache=None,
):
    """Twin of kernels.qk_rope.qk_rope → (q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D]) bf16;
    with a cache (reference.kv_layout.LayerKV) then write_ref(cache, k, v, positions, n).

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
    v = v.clone()
    if cache is not None:
        write_ref(cache, k, v, positions, n)
    return q, k, v


def qkv_rope_ref(
    x, weight, scale_inv, q_norm_weight, k_norm_weight, positions, table, n_live=None, *,
    num_q_heads: int, num_kv_heads: int, eps: float, splits: int, cache=None,
):
    """Twin of kernels.qk_rope.qkv_rope → (partials [S, n, W] FP32, q, k, v):
    linear_fp8_partials_ref then qk_rope_ref on those partials."""
    parts = linear_fp8_partials_ref(x, weight, scale_inv, n_live, splits=splits)
    return (parts, *qk_rope_ref(parts, q_norm_weight, k_norm_weight, positions, table,
                                parts.shape[1], num_q_heads=num_q_heads,
                                num_kv_heads=num_kv_heads, eps=eps, cache=cache))
