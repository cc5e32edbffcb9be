"""Twins of the block-FP8 MoE (kernels/moe.py): gate/up with SiLU·mul and the
activation's requantization, then down, summed over the routed experts. Each rounds at exactly
the kernel's quantization points; what remains between the two is FP32 accumulation order (and
ulp-level exp differences inside SiLU).

Dimension letters: R rows in the buffer, n live rows, H hidden, E experts, K top-k, I expert
intermediate, S = R·K slots (slot r·K + k is row r's k-th expert).
"""

from __future__ import annotations

import torch

from reference import ops
from reference.twins.fp8 import _n_live


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU(g)·u in FP32, written as the kernel computes it: g / (1 + exp(−g)), then × u (exp as
    ops.exp32, the FP32 exp whose bits do not depend on the CPU's code path)."""
    return g / (1.0 + ops.exp32(-g)) * u


def _slots_by_expert(ids: torch.Tensor):
    """For each distinct expert e in ids [n, K]: (e, slot indices r·K + k routed to e)."""
    k = ids.shape[1]
    for e in torch.unique(ids).tolist():
        rows, ks = torch.nonzero(ids == e, as_tuple=True)
        yield e, rows * k + ks


def _dequant_cpu(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return ops.dequant_block(w.cpu(), s.cpu())


def moe_gate_up_fp8_ref(
    x: torch.Tensor,  # [R, H]
    ids: torch.Tensor,  # [R, K]
    fc: torch.Tensor,  # [E, 2I, H] E4M3, gate rows then up rows
    fc_scale_inv: torch.Tensor,  # [E, ⌈2I/128⌉, ⌈H/128⌉]
    n_live=None,
    dequant=None,  # (w, s) → FP32 weight; a memoizing stand-in may be passed (iquestrt/ops.py)
) -> torch.Tensor:
    """Twin of kernels.moe.moe_gate_up_fp8 → SiLU(gate)·up, FP32 [n·K, I].

    x is quantized per row per 128 columns (the kernel's act-quant) and dequantized; weights are
    dequantized exactly; gate and up are FP32 GEMMs.
    """
    n = _n_live(n_live, x.shape[0])
    dequant = dequant or _dequant_cpu
    ids = ids[:n].cpu().long()
    inter = fc.shape[1] // 2
    xd = ops.dequant_act(*ops.quantize_act(x[:n].cpu()))  # [n, H]
    xs = xd.repeat_interleave(ids.shape[1], dim=0)  # [n·K, H], slot order
    a = torch.zeros(n * ids.shape[1], inter)
    for e, slots in _slots_by_expert(ids):
        w = dequant(fc[e], fc_scale_inv[e])  # [2I, H]
        g = ops.gemm(xs[slots], w[:inter]).float()
        u = ops.gemm(xs[slots], w[inter:]).float()
        a[slots] = silu_mul(g, u)
    return a


def moe_down_fp8_ref(
    a: torch.Tensor,  # [S, I] FP32 (rows ≥ n·K ignored)
    weights: torch.Tensor,  # [R, K] FP32 router weights
    ids: torch.Tensor,  # [R, K]
    proj: torch.Tensor,  # [E, H, I] E4M3
    proj_scale_inv: torch.Tensor,  # [E, ⌈H/128⌉, ⌈I/128⌉]
    n_live=None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    dequant=None,
) -> torch.Tensor:
    """Twin of kernels.moe.moe_down_fp8 → [n, H].

    The intermediate is quantized per slot per 128 columns (E4M3, FP32 scales: the kernel does
    this on purpose, it is what the down GEMM consumes) and dequantized; down is an FP32 GEMM;
    the K expert outputs of a row are summed in k order with the FP32 router weights, rounded
    once to out_dtype.
    """
    n = _n_live(n_live, weights.shape[0])
    dequant = dequant or _dequant_cpu
    ids = ids[:n].cpu().long()
    k = ids.shape[1]
    ad = ops.dequant_act(*ops.quantize_act(a[: n * k].cpu()))  # [n·K, I]
    y = torch.zeros(n * k, proj.shape[1])  # [n·K, H]
    for e, slots in _slots_by_expert(ids):
        y[slots] = ops.gemm(ad[slots], dequant(proj[e], proj_scale_inv[e])).float()
    w = weights[:n].cpu().float()
    y = y.view(n, k, -1)
    acc = torch.zeros(n, proj.shape[1])
    for j in range(k):
        acc = acc + w[:, j : j + 1] * y[:, j]
    return acc.to(out_dtype)


def moe_fp8_ref(
    x: torch.Tensor,  # [R, H]
    weights: torch.Tensor,  # [R, K] FP32
    ids: torch.Tensor,  # [R, K]
    fc: torch.Tensor,
    fc_scale_inv: torch.Tensor,
    proj: torch.Tensor,
    proj_scale_inv: torch.Tensor,
    n_live=None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    dequant=None,
) -> torch.Tensor:
    """Twin of kernels.moe.moe_fp8: gate/up twin, then down twin → [n, H] out_dtype."""
    a = moe_gate_up_fp8_ref(x, ids, fc, fc_scale_inv, n_live, dequant)
    return moe_down_fp8_ref(a, weights, ids, proj, proj_scale_inv, n_live, out_dtype=out_dtype,
                            dequant=dequant)
