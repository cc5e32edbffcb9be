"""Reference twins of kernels/sampler.py (`sample_ref`) and kernels/verify.py (`verify_ref`),
with the kernels' signatures, built only from reference.sampling, reference.rejection and
reference.rng. They compute on the CPU and return live rows only ([n, …]); launch options
(shards, config, out) are accepted and ignored, because the kernels promise identical bits for
every such choice.

Dimension letters: R rows, n live rows, V vocabulary, W served width, D drafts, Kp / Kq the
widths of the sparse target / draft rows.
"""

from __future__ import annotations

import torch

from reference.config import SamplingDefaults
from reference.rejection import verify
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


def densify(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Sparse served rows (ids [M, W], probs [M, W]) → [M, V]; entries with prob 0 (and their
    ids, which may be −1 padding) are skipped."""
    dense = torch.zeros(ids.shape[0], vocab, dtype=torch.float32)
    rows, cols = torch.nonzero(probs > 0, as_tuple=True)
    dense[rows, ids[rows, cols].long()] = probs[rows, cols].float()
    return dense


def verify_ref(
    p_ids: torch.Tensor,  # [D+1, Kp] target served rows (sampler output, D+1 rows)
    p_probs: torch.Tensor,  # [D+1, Kp]
    q_ids: torch.Tensor,  # [D, Kq] the draft's served rows
    q_probs: torch.Tensor,  # [D, Kq]
    drafts: torch.Tensor,  # [D]
    seed,
    first_position,  # int or tensor [1]
    *,
    n_drafts=None,  # live drafts D' ≤ D (rows beyond are ignored)
    out=None,
) -> tuple[int, int, bool, list[int]]:
    """(n_accepted, next_token, bonus, emitted tokens) of reference.rejection.verify on the
    densified rows (vocabulary = largest id + 1: columns beyond it hold zeros anyway)."""
    D = _live(n_drafts, drafts.shape[0])
    pi, pp = p_ids[: D + 1].cpu(), p_probs[: D + 1].cpu()
    qi, qp = q_ids[:D].cpu(), q_probs[:D].cpu()
    d = drafts[:D].cpu().to(torch.int64)
    vocab = 1 + max([int(t.max()) for t in (pi, qi, d) if t.numel()] + [0])
    P, Q = densify(pi, pp, vocab), densify(qi, qp, vocab)
    first = int(torch.as_tensor(first_position).reshape(-1)[0])
    res = verify(P, Q, d, seed_int(seed), first)
    return res.n_accepted, res.next_token, res.bonus, res.emitted(d)
