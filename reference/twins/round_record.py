"""Twins of kernels/round_record.py: the round program's own bookkeeping in torch — the fault
record of non-finite logits and the record of one draft step. These are the definitions the
round had before it had kernels (iquestrt/round.py calls either through the op table).

A fault (code, round, where, value) is recorded only while none is: the request's first fault
stays (iquestrt/state.py lists the codes; FaultLog in reference/op_types.py).

Dimension letters: R rows, V vocabulary, W served width, Db draft slots.
"""

from __future__ import annotations

import torch

from reference.op_types import DraftRecord, FaultLog, RoundState, SampleOut, VerifyOut


def _scalar(x, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.reshape(()).long()
    return torch.full((), int(x), dtype=torch.int64, device=device)


def record_fault_ref(log: FaultLog, cond: torch.Tensor, code: int, where, value) -> None:
    """(code, round, where, value) into log.fault when cond [1] bool holds and no fault came
    first. where / value: ints or [1] device tensors."""
    dev = log.fault.device
    new = torch.stack([torch.full((), code, dtype=torch.int64, device=dev),
                       log.round_no[0].long(), _scalar(where, dev), _scalar(value, dev)])
    first = cond & (log.fault[0] == 0)
    log.fault.copy_(torch.where(first, new, log.fault))


def check_flags_ref(flags: torch.Tensor, ran: torch.Tensor, log: FaultLog, *, code: int
                    ) -> None:
    """Fault (code, round, the first raised flag's index, 0) when a flag of flags [L] int32 is
    raised and the round ran (ran [1] int32 > 0)."""
    flagged = flags != 0
    record_fault_ref(log, flagged.any().reshape(1) & (ran > 0), code,
                     torch.argmax(flagged.int()), 0)


def check_logits_ref(logits: torch.Tensor, n_live: torch.Tensor, log: FaultLog, *, code: int,
                     where: int) -> None:
    """Fault (code, round, where, 0) when a live row (< n_live [1]) of logits [R, V] holds NaN
    or ±inf."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    bad = (~torch.isfinite(logits)).any(dim=1) & (rows < n_live)
    record_fault_ref(log, bad.any().reshape(1), code, where, 0)


def record_draft_ref(out: SampleOut, one: torch.Tensor, j: int, rec: DraftRecord,
                     log: FaultLog, *, vocab: int, code: int) -> None:
    """Depth j's draft from its sample out (row 0) when one [1] int32 is 1: y = out.tokens[0]
    (fault (code, round, j, y) when outside [0, V), then clamped into it), q_ids[j] /
    q_probs[j] = the served row, drafts[j] = y, n_d += one. With one = 0: q_ids[j] = −1,
    q_probs[j] = 0, drafts[j] = 0."""
    live = one > 0
    y = torch.where(live, out.tokens[:1], 0)  # [1]
    record_fault_ref(log, live & ((y < 0) | (y >= vocab)), code, j, y)
    y = y.clamp(0, vocab - 1)
    rec.q_ids[j] = torch.where(live, out.ids[0], -1)
    rec.q_probs[j] = torch.where(live, out.probs[0], 0.0)
    rec.drafts[j] = y[0]
    rec.n_d.add_(one)


def settle_round_ref(v: VerifyOut, keep_d: torch.Tensor, hidden: torch.Tensor, rec: DraftRecord,
                     s: RoundState, *, vocab: int, code: int) -> None:
    """The state after verification (the caches were rolled back before): the token fault of
    v.next_token (code, round, −1, token) when outside [0, V); when the round ran (done 0):
    draft_next = keep_d [1] int32, the hidden rows [R, H] and their base m, the a + 1 emitted
    tokens at m + 1 …, the log row `round` (head, emitted, the draft record), m += a + 1,
    n_new += a + 1, round += 1, done when a stop id was emitted, the budget is reached or a
    fault is recorded. A round of a finished request writes only the dump slot and dump row."""
    rows = s.hidden.shape[0]
    ar = torch.arange(rows, dtype=torch.int32, device=s.m.device)
    dump_slot, dump_row = s.tokens.shape[0] - 1, s.head.shape[0] - 1
    go = 1 - s.done
    live = go > 0
    m = s.m
    a = (v.n_accepted * go).to(torch.int32)  # [1]
    nxt_tok = v.next_token[:1]
    record_fault_ref(FaultLog(s.fault, s.round_no), live & ((nxt_tok < 0) | (nxt_tok >= vocab)),
                     code, -1, nxt_tok)
    n_em = (a + 1) * go  # tokens this round emits
    s.draft_next.copy_(torch.where(live, keep_d, s.draft_next))
    s.hidden.copy_(torch.where(live, hidden, s.hidden))
    s.hidden_at.copy_(torch.where(live, m, s.hidden_at))
    em_live = ar < n_em  # [R] emitted slots of this round
    em = torch.where(em_live, v.emitted[:rows], -1)
    slot = torch.where(em_live, m + 1 + ar, dump_slot).long()
    s.tokens.index_put_((slot,), em)
    hit_stop = ((em[:, None] == s.stop[None, :]).any(dim=1) & em_live).any().reshape(1)
    n_new = s.n_new + n_em
    faulted = s.fault[:1] != 0
    finished = live & (hit_stop | (n_new >= s.max_new) | faulted)
    row = torch.where(live, s.round_no, dump_row).long()
    head = torch.stack([m[0], a[0], v.bonus[0].to(torch.int32), rec.n_d[0].to(torch.int32),
                        n_em[0]])[None]
    s.head.index_copy_(0, row, head.to(torch.int32))
    s.emitted.index_copy_(0, row, em[None])
    s.drafts.index_copy_(0, row, rec.drafts[None])
    s.q_ids.index_copy_(0, row, rec.q_ids[None])
    s.q_probs.index_copy_(0, row, rec.q_probs[None])
    s.m.copy_(m + n_em)
    s.n_new.copy_(n_new)
    s.round_no.copy_(s.round_no + go)
    s.done.copy_(torch.where(finished | faulted, 1, s.done).to(torch.int32))
