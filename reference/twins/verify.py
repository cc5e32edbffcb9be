"""Twin of kernels/verify.py (`verify_ref`): reference.rejection.verify on the
densified served rows of the target and the draft.

Dimension letters: V vocabulary, W served width, D drafts, Kp / Kq the widths of the sparse
target / draft rows.
"""

from __future__ import annotations

import torch

from reference.rejection import verify
from reference.twins.sampler import _live, seed_int


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
