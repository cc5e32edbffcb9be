"""What the split and combine programs of kernels/attention/ share: the log constants, the
interpreter's bf16 rounding, the live-row scalar and the split results.

Dimension letters as in kernels/attention/.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def rne_bf16(x):
    """FP32 → the nearest bf16 value (ties to even), kept in FP32. Used only under the
    interpreter, whose float → bf16 cast truncates; compiled kernels round natively."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@dataclass(frozen=True)
class Partials:
    o: torch.Tensor  # [S, R, Hq, D] FP32, normalised within each split; unwritten where lse = −inf
    lse: torch.Tensor  # [S, R, Hq] FP32 natural-log sum-exp of scale·⟨q, k⟩; −inf: no keys


def n_live_tensor(n_live, dev) -> torch.Tensor:
    if isinstance(n_live, torch.Tensor):
        if n_live.dtype != torch.int32 or n_live.numel() != 1 or n_live.device != dev:
            raise ValueError(f"attention: n_live must be a 1-element int32 tensor on {dev}, got "
                             f"{n_live.dtype} {tuple(n_live.shape)} on {n_live.device}")
        return n_live
    return torch.tensor([int(n_live)], dtype=torch.int32, device=dev)
