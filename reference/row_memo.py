"""Matched-precision forwards memoized row by row, for many requests that share their prefixes.

In Precision "matched" the reference computes every row on its own against the cache rows before
it (reference/model.py, `_one_row_at_a_time`), so a row's logits, hidden state and K/V are a pure
function of (its token, its position, its draft input hprev, the cache rows it sees). `RowMemo`
wraps a ReferenceModel with the same interface the generator uses (`cfg`, `target`, `draft`,
`new_target_cache`, `new_draft_cache`) and computes each distinct row once: requests with the
same prompt share the prefill, and requests whose sampled tokens agree share the rows after it.
The bits are those of the plain model: a row found in the memo is the row the model computed.

Keying the cache. A `MemoCache` records, beside its K/V, the memo id of the row at each position.
An id names a row together with the whole cache it was computed on (the key holds the id of the
row before it), so the last id of a cache names its entire content: the memo is a trie of rows.
Truncating or cloning a MemoCache keeps the ids with the rows. A MemoCache written by anything
but its RowMemo (ids and rows out of step) is refused.

What is shared, and why copies. Memo entries are never handed out: a hit appends copies of the
stored K/V to the caller's cache and returns newly allocated logits and hidden rows, so a request
that modifies its outputs or cache cannot change what later requests see.

Not for other precisions (their rows depend on how a call batches them: refused), nor while the
model's computation changes (a patch applied after the memo has entries is not seen; make a new
RowMemo inside the patch). Traces (`layer_trace`, `route_trace`) see only the rows computed. The
memo grows with every distinct row and lives as long as the RowMemo.

Dimension letters: R rows, H hidden, V vocabulary, Hkv K/V heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.model import KVCache, Output, ReferenceModel


class MemoCache(KVCache):
    """A KVCache that also holds the RowMemo id of the row at each cached position."""

    def __init__(self, n_layers: int, start: int = 0):
        super().__init__(n_layers, start)
        self.row_ids: list[int] = []

    def truncate(self, next_position: int) -> None:
        super().truncate(next_position)
        del self.row_ids[next_position - self.start :]

    def clone(self) -> MemoCache:
        plain = super().clone()
        c = MemoCache(len(self.k), self.start)
        c.k, c.v, c.row_ids = plain.k, plain.v, list(self.row_ids)
        return c


@dataclass(frozen=True)
class _Row:
    id: int
    k: tuple[torch.Tensor, ...]  # per layer [1, Hkv, D]
    v: tuple[torch.Tensor, ...]
    logits: torch.Tensor  # [1, V]
    hidden: torch.Tensor  # [1, H]


def _bits(x: torch.Tensor) -> tuple:
    """An exact key for a tensor: dtype, shape and bytes (−0.0 and NaN payloads distinct)."""
    x = x.detach().contiguous()
    return str(x.dtype), tuple(x.shape), x.reshape(-1).view(torch.uint8).numpy().tobytes()


class RowMemo:
    """A ReferenceModel in Precision "matched" whose target and draft rows are memoized."""

    def __init__(self, model: ReferenceModel):
        if not model.precision.matched:
            raise ValueError(
                f"RowMemo: precision {model.precision.name!r} computes rows together; only "
                "'matched' computes each row on its own, so that a row can be memoized")
        self.model = model
        self.cfg = model.cfg
        self.precision = model.precision
        self._rows: dict[tuple, _Row] = {}
        self.hits = 0  # rows served from the memo
        self.misses = 0  # rows computed

    def new_target_cache(self) -> MemoCache:
        return MemoCache(self.cfg.target.num_hidden_layers, start=0)

    def new_draft_cache(self) -> MemoCache:
        return MemoCache(1, start=1)

    def target(self, tokens: torch.Tensor, positions: torch.Tensor,
               cache: MemoCache | None = None) -> Output:
        """As ReferenceModel.target; cache None: a scratch cache at the first row's position."""
        if cache is None:
            cache = MemoCache(self.cfg.target.num_hidden_layers, start=int(positions[0]))
        return self._rows_of("target", cache, positions, tokens, None)

    def draft(self, tokens: torch.Tensor, hprev: torch.Tensor, positions: torch.Tensor,
              cache: MemoCache | None = None) -> Output:
        """As ReferenceModel.draft; hprev is part of each row's key, bit for bit."""
        if cache is None:
            cache = MemoCache(1, start=int(positions[0]))
        return self._rows_of("draft", cache, positions, tokens, hprev)

    def _rows_of(self, kind: str, cache: MemoCache, positions, tokens, hprev) -> Output:
        if not isinstance(cache, MemoCache) or len(cache.row_ids) != cache.length:
            raise ValueError("RowMemo: the cache must be a MemoCache written only by its RowMemo")
        logits, hidden = [], []
        for r in range(positions.shape[0]):
            pos, tok = positions[r : r + 1], tokens[r : r + 1]
            if int(pos) != cache.next_position:  # as the model's own check, also for a hit
                raise ValueError(f"RowMemo: row at position {int(pos)}, the cache expects "
                                 f"{cache.next_position}")
            h = None if hprev is None else hprev[r : r + 1]
            key = self._key(kind, cache, tok, pos, h)
            row = self._rows.get(key)
            if row is None:
                row = self._compute(kind, cache, pos, tok, h)
                self._rows[key] = row
                self.misses += 1
            else:
                for layer in range(len(cache.k)):
                    cache.append(layer, row.k[layer].clone(), row.v[layer].clone())
                self.hits += 1
            cache.row_ids.append(row.id)
            logits.append(row.logits)
            hidden.append(row.hidden)
        return Output(torch.cat(logits), torch.cat(hidden))

    def _key(self, kind: str, cache: MemoCache, tok, pos, h) -> tuple:
        """Everything a matched row depends on: the cache's content (the id of its last row),
        the token, the position and, for the draft, the bits of hprev."""
        parent = cache.row_ids[-1] if cache.row_ids else None
        return kind, parent, int(tok), int(pos), None if h is None else _bits(h)

    def _compute(self, kind: str, cache: MemoCache, pos, tok, h) -> _Row:
        """One row on the plain model, which appends its K/V to cache."""
        if kind == "target":
            out = self.model.target(tok, pos, cache)
        else:
            out = self.model.draft(tok, h, pos, cache)
        n = len(cache.k)
        return _Row(len(self._rows), tuple(cache.k[i][-1:].clone() for i in range(n)),
                    tuple(cache.v[i][-1:].clone() for i in range(n)),
                    out.logits.clone(), out.hidden.clone())
