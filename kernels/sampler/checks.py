"""Host-side argument checks of the sampler wrappers in kernels/sampler/ (`seed_args` also
serves kernels/verify.py). Every failure is a ValueError prefixed "kernels.sampler:"."""

from __future__ import annotations

import torch

from kernels.sampler.values import DeviceSampling
from reference.config import SamplingDefaults
from reference.rng import MASK32, Purpose


def _fail(msg: str):
    raise ValueError(f"kernels.sampler: {msg}")


def _split(params, vocab: int, device):
    """(host parameters for the checks and scalar arguments, DeviceSampling.values or None).
    A DeviceSampling's values were validated on the host when written; its host stand-in
    carries only its shape (top_k, greedy) — the kernels read temperature and top-p from values."""
    if isinstance(params, DeviceSampling):
        _check("params.values", params.values, 1, (torch.float32,), device)
        if params.values.numel() != 3:
            _fail(f"params.values must hold 3 values, got {params.values.numel()}")
        stand_in = SamplingDefaults(0.0 if params.greedy else 1.0, params.top_k, 1.0)
        return stand_in, params.values
    return params, None


def _check(name: str, t, dims: int, dtypes, device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        _fail(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        _fail(f"{name} must be on {device}, got {t.device}")


def _n_live(n_live, rows: int, device) -> torch.Tensor:
    if n_live is None:
        return torch.full((1,), rows, dtype=torch.int32, device=device)
    _check("n_live", n_live, 1, (torch.int32,), device)
    if n_live.numel() != 1:
        _fail(f"n_live must hold one element, got shape {tuple(n_live.shape)}")
    return n_live


def seed_args(seed, device) -> tuple[int, torch.Tensor | None]:
    """(scalar, pointer) kernel arguments for a uint64 seed given as an int or as a device
    int64 tensor [1] holding its bits (a tensor keeps the seed out of a captured CUDA graph)."""
    if isinstance(seed, torch.Tensor):
        _check("seed", seed, 1, (torch.int64,), device)
        if seed.numel() != 1:
            _fail(f"seed tensor must hold one element, got shape {tuple(seed.shape)}")
        return 0, seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        _fail(f"seed must be an integer in [0, 2^64) or an int64 device tensor [1], got {seed!r}")
    return seed, None


def _rng_words(purpose, index) -> tuple[int, int]:
    try:
        purpose = Purpose(purpose)
    except ValueError:
        _fail(f"purpose must be one of {list(Purpose)}, got {purpose!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MASK32:
        _fail(f"index must be an integer in [0, 2^32), got {index!r}")
    return int(purpose), index


def _check_positions(positions, rows: int, device) -> None:
    _check("positions", positions, 1, (torch.int64, torch.int32), device)
    if positions.shape[0] != rows:
        _fail(f"positions must be [R={rows}], got {tuple(positions.shape)}")
