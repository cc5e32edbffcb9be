"""One speculative round as a straight-line program over device state (iquestrt/state.py): no
host reads, fixed shapes, so the same code runs eagerly or captured in a CUDA graph (one graph
per draft depth, i.e. per verification width; iquestrt/graphs.py). Round semantics are those of
reference/speculative.py; the host-int engine they replace is described in iquestrt/engine.py.

Every live-row count is a device scalar multiplied by go = 1 − done, so a round launched after
the request finished (or failed) runs each kernel with 0 live rows and every state update below
is a `where(go, new, old)`: it commits nothing.

  depth 0   catch-up rows draft_next … m (c = m − draft_next + 1: "keep" 1 row, or 2 after a
            round that accepted every draft; "recompute" a+1 ≤ R rows), token at p with the
            target hidden of p − 1 (hidden_at …)
  depth j   one row at position draft_next, token y_j with the previous depth's hidden (its
            operand built inside the eh_proj GEMM: no entry launch); with
            an adaptive policy (reference/depth.py) a control step on the device decides after
            each depth ≥ 3 whether the next runs: a skipped depth runs nothing under conditional
            graphs (iquestrt/cond_graph.py), its kernels with 0 live rows when launched eagerly,
            and the verification width shrinks to 1 + drafts run
  target    [x_m, y_1 … y_D] at positions m … m+D; sample; verify (a accepted)
  settle    target caches keep positions < m+a+1 (written through m+D); the draft ring keeps
            < min(m+a+1, its next position) ("keep"), or < min(m+1, …) ("recompute": the next
            depth 0 rewrites m+1 … m+a+1, c = a+1 rows); hidden ← the target's rows m … m+D;
            m ← m+a+1

Dimension letters: R rows, Db draft slots, W served width, V vocabulary, H hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from iquestrt.ops import Live
from iquestrt.state import (
    FAULT_DRAFT_LOGITS,
    FAULT_READINESS,
    FAULT_TARGET_LOGITS,
    FAULT_TOKEN,
    DeviceState,
)
from reference.depth import AdaptiveDepth, FixedDepth, push_features
from reference.op_types import DraftRecord, RoundBegin, SettleBounds, TargetRows
from reference.rng import Purpose


def _served_features(out, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q(y) and the entropy of the served row (fp32, on the device) → ([1], [1])."""
    ids, probs = out.ids[0], out.probs[0]  # [W]
    q = (probs * (ids == y).to(probs.dtype)).sum().reshape(1)
    logs = torch.where(probs > 0, probs.clamp(min=1e-30).log(), 0.0)
    return q, (-(probs * logs).sum()).reshape(1)


@dataclass
class _Carry:
    """What a depth hands to the next: the last forward's logits [R, V] / hidden [R, H] and its
    last live row, 1 while depths run, control features. The positions and the drafts run
    live in fixed buffers (RoundProgram.begin, rec.n_d), so no value crosses a segment
    boundary except through these (see RoundProgram.segments)."""

    logits: torch.Tensor | None
    hid: torch.Tensor | None
    last: torch.Tensor | None
    one: torch.Tensor  # [1] int32
    feat: torch.Tensor  # [1, 3] fp32


class RoundProgram:
    """Callable: one round of fixed draft depth on `st` (see the module docstring).

    segments(): the same round as separately capturable parts, for conditional graphs
    (iquestrt/cond_graph.py): pre (depth 0 … min_depth − 1 and the control step deciding depth
    min_depth), one part per later depth k (forward k, sample, control), post (target, verify,
    settle). A depth part runs only when the previous control said so. Its positions were all
    written by pre (begin.pos), and the drafts run are counted in rec.n_d, so post derives the
    draft cache's next position from them (target_rows) whether the depth parts ran or not.
    Fixed depth: one part. Calling the program runs the parts in order (later depths gated by
    0 live rows, or on the CPU skipped).

    The round's scalar arithmetic is three ops of the table (kernels/round_scalars.py), one
    launch each: begin_round, target_rows, settle_bounds."""

    def __init__(self, engine, st: DeviceState, policy: FixedDepth | AdaptiveDepth):
        """Reads the request only through st (its seed, sampling values, budget and stop ids on
        the device), so one program — and a graph captured from it — serves every request that
        st.fits."""
        self.e, self.st, self.depth = engine, st, policy.max_depth
        self.adaptive = policy if isinstance(policy, AdaptiveDepth) else None
        self.table = self.adaptive.table(st.tokens.device) if self.adaptive else None
        self._host_cpu = st.tokens.device.type == "cpu"  # device reads are free there
        rows, dev = st.rows, st.tokens.device
        width = st.q_ids.shape[2]
        self.q_ids = torch.full((rows - 1, width), -1, dtype=torch.int64, device=dev)
        self.q_probs = torch.zeros(rows - 1, width, dtype=torch.float32, device=dev)
        self.d_buf = torch.zeros(rows - 1, dtype=torch.int64, device=dev)  # [Db] drafts
        self.nd_buf = torch.zeros(1, dtype=torch.int32, device=dev)
        # the draft steps' record (ops.record_draft); n_d is nd_buf itself, zeroed by pre
        self.rec = DraftRecord(self.q_ids, self.q_probs, self.d_buf, self.nd_buf)
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        self.begin = RoundBegin(torch.zeros(1, **i32), torch.zeros(1, **i32),
                                torch.zeros(1, **i32), torch.zeros(1, **i64),
                                torch.zeros(rows - 1, **i32),
                                torch.zeros(1, 3, dtype=torch.float32, device=dev))
        self.target = TargetRows(torch.zeros(1, **i32), torch.zeros(rows, **i64),
                                 torch.zeros(rows, **i32), torch.zeros(rows, **i64),
                                 torch.zeros(1, **i64), torch.zeros(1, **i32))
        self.bounds = SettleBounds(*(torch.zeros(1, **i32) for _ in SettleBounds._fields))
        self.row0 = torch.zeros(1, dtype=torch.int64, device=dev)  # a depth's last row: 0
        lo = self.adaptive.min_depth if self.adaptive else self.depth
        self.split = tuple(range(lo, self.depth)) if self.depth > 0 else ()  # skippable depths
        self._carry: _Carry | None = None
        self._stopped = False

    def __call__(self) -> None:
        one = self.pre()
        for k in self.split:
            if self._stopped or (self._host_cpu and int(one[0]) == 0):
                break  # CPU: a skipped depth runs nothing (the twins refuse 0 rows)
            one = self.depth_part(k)
        if not self._stopped:
            self.post()

    def segments(self) -> tuple[Callable[[], torch.Tensor], list, Callable[[], None]]:
        """(pre, [(k, part k) …], post); pre and part k return the [1] int32 flag 'run the next
        depth'."""
        return self.pre, [(k, lambda k=k: self.depth_part(k)) for k in self.split], self.post

    # --- the parts ------------------------------------------------------------------------------

    def pre(self) -> torch.Tensor:
        st, e, b = self.st, self.e, self.begin
        self._stopped = False
        # depths ≥ split[0] may be skipped (conditional graphs): their q rows start −1 / 0
        e.ops.begin_round(st.round_state, self.rec, b,
                          clear_from=self.split[0] if self.split else st.rows - 1)
        cy = _Carry(None, None, None, b.go, b.feat)
        if self.depth > 0:
            # one entry launch: c = b.c catch-up rows from draft_next (token at p, slots clamp
            # at the dump slot; the target hidden of p − 1: row p − 1 − hidden_at of st.hidden)
            cy.logits, cy.hid, _ = e.draft.forward_entry(
                st.tokens, st.draft_next, st.dump_slot, st.hidden, b.hid_base, st.draft_next,
                Live.on_device(b.c), e.session.caches.draft)
            e.ops.check_logits(cy.logits, Live.on_device(b.c), st.log, code=FAULT_DRAFT_LOGITS,
                               where=0)
            if self._host_stop():
                self._stopped = True
                return cy.one
            cy.last = b.last
            self._steps(cy, 0, self.split[0] if self.split else self.depth)
        self._carry = cy
        return cy.one

    def depth_part(self, k: int) -> torch.Tensor:
        cy = self._carry
        self._steps(cy, k, k + 1, forward_first=True)
        return cy.one

    def _steps(self, cy: _Carry, j0: int, j1: int, forward_first: bool = False) -> None:
        """Depths j0 … j1−1: [forward of depth j,] sample its draft, control step."""
        st, e, ops = self.st, self.e, self.e.ops
        R, vocab = st.rows, e.cfg.target.vocab_size
        for j in range(j0, j1):
            if j > j0 or forward_first:
                if self._host_cpu and int(cy.one[0]) == 0:
                    return  # CPU: a skipped depth runs nothing
                # one row: draft y_j (d_buf[j − 1]) with the previous depth's last hidden,
                # its operand built inside the eh_proj GEMM (kernels/eh_proj.py)
                cy.logits, cy.hid, _ = e.draft.forward_entry(
                    self.d_buf, j - 1, R - 2, cy.hid, cy.last, self.begin.pos[j - 1:j],
                    Live.on_device(cy.one), e.session.caches.draft, fused=True)
                ops.check_logits(cy.logits, Live.on_device(cy.one), st.log,
                                 code=FAULT_DRAFT_LOGITS, where=j)
                if self._host_stop():
                    self._stopped = True
                    return
                cy.last = self.row0
            # [1, V]: the depth's last row (row 0 after a one-row forward: a view, no launch)
            row = (cy.logits[:1] if cy.last is self.row0
                   else cy.logits.index_select(0, cy.last))
            out = ops.sample(row, st.sampling, st.seed, self.begin.pos[j:j + 1],
                             Purpose.DRAFT_SAMPLE, Live.on_device(cy.one))  # positions [1] int32
            # y_j (clamped into the vocabulary) into d_buf[j], the served row into q_*[j]
            ops.record_draft(out, cy.one, j, self.rec, st.log, vocab=vocab, code=FAULT_TOKEN)
            if j < self.depth - 1 and self.adaptive is not None:  # run depth j + 1?
                y = self.d_buf[j:j + 1]
                cy.feat = push_features(cy.feat, *_served_features(out, y))
                more = self.adaptive.more_batch(j + 1, cy.feat, self.table)
                cy.one = cy.one * more.to(torch.int32)

    def post(self) -> None:
        st, e, ops = self.st, self.e, self.e.ops
        b, t = self.begin, self.target
        # target verification rows [x_m, y_1 … y_d], d = drafts run (adaptive: ≤ depth)
        ops.target_rows(st.round_state, self.rec, b, t)
        logits, hidden = e.target.forward_rows(t.tokens, t.pos, Live.on_device(t.n_t),
                                               e.session.caches, e.session.flags)
        ops.check_flags(e.session.flags, b.go, st.log, code=FAULT_READINESS)
        ops.check_logits(logits, Live.on_device(t.n_t), st.log, code=FAULT_TARGET_LOGITS,
                         where=0)
        if self._host_stop():
            return
        p = ops.sample(logits, st.sampling, st.seed, t.sample_pos, Purpose.TARGET_SAMPLE,
                       Live.on_device(t.n_t))
        v = ops.verify(p, self.q_ids, self.q_probs, self.d_buf, st.seed, t.first,
                       Live.on_device(self.nd_buf))
        self._settle(v, hidden)

    def _host_stop(self) -> bool:
        """On the CPU (twins, interpreter) a recorded fault ends the round at once: the twins'
        sampler refuses non-finite logits. Free to read there; never read on a GPU."""
        st = self.st
        return self._host_cpu and bool(st.fault[0] != 0)

    def _settle(self, v, hidden) -> None:
        st, ops, caches = self.st, self.e.ops, self.e.session.caches
        bd = self.bounds
        ops.settle_bounds(v, st.round_state, self.target, self.begin.go, bd,
                          recompute=self.e.cfg.draft.recompute_settled)
        # the target caches keep positions < m + a + 1 (or m when nothing ran) of those written
        # through m + n_t; the draft ring < min(settled_draft_next, its next position)
        ops.rollback_layers(caches.target, bd.keep, bd.written)
        ops.rollback(caches.draft, bd.keep_d, self.target.nxt)
        # then the next token's fault, the emitted tokens, hidden rows, log row, m, n_new,
        # round and done, all read from the state before the settlement (kernels/round_record)
        ops.settle_round(v, bd.keep_d, hidden, self.rec, st.round_state,
                         vocab=self.e.cfg.target.vocab_size, code=FAULT_TOKEN)
