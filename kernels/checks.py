"""Host-side argument checks of the kernel wrappers: each raises a ValueError that names the
offending argument before anything is launched, and none reads a device value back to the host.

Owns: a tensor's rank / shape / dtype / device (`check_tensor`), the live-row count as a device
tensor (`live_count`), and a quantize_act pair handed in by a producer kernel
(`check_quantized`). No Triton code here; kernels/fp8.py imports this module, so the FP8 format
is spelled from torch and reference.params rather than taken from there.
"""

from __future__ import annotations

import torch

from reference.params import FP8_BLOCK


def check_tensor(name: str, t, *, dims: int | None = None, shape=None, dtypes=None, device=None):
    """ValueError naming `name` unless t has the expected rank / shape (None entries free) /
    dtype / device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        want = tuple(shape)
        if t.dim() != len(want) or any(
            w is not None and w != g for w, g in zip(want, t.shape, strict=True)
        ):
            shown = tuple("*" if w is None else w for w in want)
            raise ValueError(f"{name}: expected shape {shown}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def live_count(n_live, rows: int, device: torch.device) -> torch.Tensor:
    """n_live as a device int32 tensor of one element (never read on the host)."""
    if n_live is None:
        return torch.full((1,), rows, dtype=torch.int32, device=device)
    check_tensor("n_live", n_live, dtypes=(torch.int32,), device=device)
    if n_live.numel() != 1:
        raise ValueError(f"n_live: expected one element, got shape {tuple(n_live.shape)}")
    return n_live


def check_quantized(name: str, pair, rows: int, cols: int, device) -> tuple:
    """pair = (q [rows, cols] E4M3, scales [rows, ⌈cols/128⌉] fp32), unit column strides: a
    quantize_act result made earlier (by a producer kernel) → the pair; ValueError naming it."""
    q, s = pair
    groups = -(-cols // FP8_BLOCK)
    for i, t, shape, dtype in ((0, q, (rows, cols), torch.float8_e4m3fn),
                               (1, s, (rows, groups), torch.float32)):
        check_tensor(f"{name}[{i}]", t, shape=shape, dtypes=(dtype,), device=device)
        if t.stride(1) != 1 and t.shape[1] > 1:
            raise ValueError(f"{name}[{i}]: expected unit column stride, got {t.stride()}")
    return q, s
