"""Twins of kernels/round_scalars.py: the scalars and row vectors a speculative round derives from
its state between the model's launches (iquestrt/round.py) — where its draft depths begin, the
verification rows, the rollback bounds. These are the torch expressions the round program
computed inline before they were kernels (each one a launch on a GPU).

Dimension letters: R rows, Db = R − 1 draft slots, W served width.
"""

from __future__ import annotations

import torch

from reference.depth import init_features
from reference.op_types import (
    DraftRecord,
    RoundBegin,
    RoundState,
    SettleBounds,
    TargetRows,
    VerifyOut,
)


def begin_round_ref(s: RoundState, rec: DraftRecord, b: RoundBegin, *, clear_from: int) -> None:
    """A round's first launch: b from the state before the round (go, depth 0's catch-up rows c,
    its hidden base and last row, the draft positions, the control features); the draft record
    emptied — drafts 0, n_d 0, and rows ≥ clear_from of q_ids / q_probs −1 / 0 (the depths a
    conditional graph may skip; every round's record_draft writes the others)."""
    go = 1 - s.done
    c = (s.m - s.draft_next + 1) * go
    b.go.copy_(go)
    b.c.copy_(c)
    b.hid_base.copy_(s.draft_next - 1 - s.hidden_at)
    b.last.copy_((c - 1).clamp(min=0).long())
    j = torch.arange(b.pos.shape[0], dtype=torch.int32, device=b.pos.device)
    b.pos.copy_(s.draft_next + c + j)
    b.feat.copy_(init_features(1, b.feat.device))
    rec.drafts.zero_()
    rec.n_d.zero_()
    rec.q_ids[clear_from:].fill_(-1)
    rec.q_probs[clear_from:].zero_()


def target_rows_ref(s: RoundState, rec: DraftRecord, b: RoundBegin, t: TargetRows) -> None:
    """After the draft depths: the verification rows [x_m, y_1 … y_d] (d = rec.n_d drafts run),
    their positions and draws, and the draft cache's next position (TargetRows)."""
    rows = t.tokens.shape[0]
    ar = torch.arange(rows, dtype=torch.int32, device=s.m.device)
    n_t = (rec.n_d + 1) * b.go
    t.n_t.copy_(n_t)
    t.tokens.copy_(torch.cat([s.tokens[s.m.long()], rec.drafts])[:rows])
    t.pos.copy_(torch.where(ar < n_t, s.m + ar, -1))
    t.sample_pos.copy_((s.m + 1 + ar).long())
    t.first.copy_((s.m + 1).long())
    t.nxt.copy_(torch.where(rec.n_d > 0, b.pos[:1] + rec.n_d - 1, s.draft_next))


def settle_bounds_ref(v: VerifyOut, s: RoundState, t: TargetRows, go: torch.Tensor,
                      out: SettleBounds, *, recompute: bool) -> None:
    """The rollback bounds after verification (a = v.n_accepted·go): the target caches keep
    positions < m + (a + 1)·go of those written through m + n_t; the draft cache keeps those
    < min(m + go ("recompute": the next depth 0 rewrites the accepted rows) or m + (a + 1)·go
    ("keep"), t.nxt) — reference.config.DraftConfig.settled_draft_next."""
    a = (v.n_accepted * go).to(torch.int32)
    n_em = (a + 1) * go  # tokens this round emits
    out.keep.copy_(s.m + n_em)
    out.written.copy_(s.m + t.n_t)
    settled = s.m + go if recompute else s.m + n_em
    out.keep_d.copy_(torch.minimum(settled, t.nxt))
