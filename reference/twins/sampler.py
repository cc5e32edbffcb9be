"""Twin of kernels/sampler/ (`sample_ref`), with the kernel's signature, built only
from reference.sampling and reference.rng. Launch options (shards, config, out) are accepted
and ignored, because the kernel promises identical bits for every such choice.

Dimension letters: R rows, n live rows, V vocabulary, W served width.
"""

from __future__ import annotations

import torch

from reference.config import SamplingDefaults
from reference.rng import Purpose, uniforms
from reference.sampling import draw, served_candidates


def seed_int(seed) -> int:
    """A seed given as an int, or as an int64 tensor [1] holding the uint64 bits."""
    if isinstance(seed, torch.Tensor):
        return int(seed.reshape(-1)[0].item()) & (2**64 - 1)
    return seed


def _live(n_live, rows: int) -> int:
    return rows if n_live is None else min(rows, int(torch.as_tensor(n_live).reshape(-1)[0]))


def sample_ref(
    logits: torch.Tensor,  # [R, V] fp32
    params: SamplingDefaults,
    seed,
    positions: torch.Tensor,  # [R]
    purpose: Purpose = Purpose.TARGET_SAMPLE,
    index: int = 0,
    *,
    shards: int = 1,
    n_live=None,
    out=None,
    config=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [n] int64, ids [n, W] int64, probs [n, W] fp32): served_candidates, then draw
    with uniforms(seed, positions, purpose, index)."""
    n = _live(n_live, logits.shape[0])
    x = logits[:n].detach().cpu()
    ids, probs = served_candidates(x, params)  # [n, W]
    dense = torch.zeros_like(x).scatter_(1, ids, probs)  # [n, V]
    u = uniforms(seed_int(seed), positions[:n].detach().cpu().to(torch.int64), purpose, index)
    return draw(dense, u), ids, probs
