"""Twin of kernels/prefetch.py (exact: the kernel sums in the same pinned order):
  part[j, r, e] = Σ_{h in chunk j, ascending} x[r, h] · P[h, e]   (FP32, each product and each
                  add rounded; chunks of SCORE_CHUNK hidden columns)
  score[r, e]   = ((0 + part[0]) + part[1]) + …                   (chunks in order)
  agg[e]        = ((0 + score[0]) + score[1]) + …                 (live rows in order)
  ids           = the m experts of largest agg (NaN counts as −inf; ties: lower index first).
The predictor P and its fit: reference/prefetch.py (run on a checkpoint and the request set by
training/prefetch_fit.py).

Dimension letters: R rows, H hidden, E experts, M predicted experts, J score chunks.
"""

from __future__ import annotations

import torch

SCORE_CHUNK = 128  # hidden columns per partial sum; pinned, the kernel uses the same


def score_partials_ref(x: torch.Tensor, p: torch.Tensor, chunk: int = SCORE_CHUNK):
    """x [T, H], p [H, E] → [J, T, E] FP32 partial sums in ascending column order. Rows are
    independent (elementwise ops only), so batching rows changes no bit."""
    x32, p32 = x.float(), p.float()
    t, hidden = x32.shape
    parts = []
    for h0 in range(0, hidden, chunk):
        acc = torch.zeros(t, p32.shape[1])
        for h in range(h0, min(h0 + chunk, hidden)):
            acc = acc + x32[:, h : h + 1] * p32[h]
        parts.append(acc)
    return torch.stack(parts)


def scores_ref(x: torch.Tensor, p: torch.Tensor, chunk: int = SCORE_CHUNK) -> torch.Tensor:
    """[T, E]: the partials added in chunk order."""
    acc = torch.zeros(x.shape[0], p.shape[1])
    for part in score_partials_ref(x, p, chunk):
        acc = acc + part
    return acc


def aggregate_ref(scores: torch.Tensor) -> torch.Tensor:
    """[…, W, E] → […, E]: the rows added in order."""
    acc = torch.zeros(scores.shape[:-2] + scores.shape[-1:])
    for w in range(scores.shape[-2]):
        acc = acc + scores[..., w, :]
    return acc


def select_ref(agg: torch.Tensor, m: int) -> torch.Tensor:
    """[…, E] → […, M] int64: largest first, NaN as −inf, ties to the lower index."""
    a = torch.where(torch.isnan(agg), float("-inf"), agg)
    return torch.sort(a, dim=-1, descending=True, stable=True).indices[..., :m]


def prefetch_experts_ref(hidden, n_live: int, p, m: int, min_rows: int, max_rows: int):
    """hidden [R, H] → the M predicted expert ids (int32), or None when n_live is outside
    [min_rows, max_rows] (the kernel then launches programs that return at once)."""
    n = min(int(n_live), hidden.shape[0])
    if not min_rows <= n <= max_rows:
        return None
    agg = aggregate_ref(scores_ref(hidden[:n], p))
    return select_ref(agg, m).to(torch.int32)
