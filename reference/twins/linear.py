"""Twins of the dense GEMMs (kernels/linear.py): block-FP8 linear, its split-K
partials, and the BF16 GEMM with an FP32 sum. Each rounds at exactly the kernel's rounding
points; what remains between the two is FP32 accumulation order inside the GEMMs.

Dimension letters: R rows in the buffer, n live rows, N output channels, K input columns,
S split-K partials.
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
