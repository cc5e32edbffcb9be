"""Twins of kernels/fp8.py: activation quantization (E4M3 per row and 128-column group)
and block dequantization, as reference/ops.py defines them.

Dimension letters: R rows in the buffer, n live rows.
"""

from __future__ import annotations

import torch

from reference import ops


def _n_live(n_live, rows: int) -> int:
    if n_live is None:
        return rows
    return int(torch.as_tensor(n_live).reshape(-1)[0].item())


def quantize_act_ref(x: torch.Tensor, n_live=None, *, rows_per_live: int = 1):
    """Twin of kernels.fp8.quantize_act: reference.ops.quantize_act on the live rows."""
    n = min(x.shape[0], _n_live(n_live, x.shape[0]) * rows_per_live)
    return ops.quantize_act(x[:n].cpu())


def dequant_block_ref(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Twin of kernels.fp8.dequant_block."""
    return ops.dequant_block(w.cpu(), scale_inv.cpu())
