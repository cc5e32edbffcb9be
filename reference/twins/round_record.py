"""Twins of kernels/round_record.py: the round program's own bookkeeping in torch — the fault
record of non-finite logits and the record of one draft step. These are the definitions the
round had before it had kernels (iquestrt/round.py calls either through the op table).

A fault (code, round, where, value) is recorded only while none is: the request's first fault
stays (iquestrt/state.py lists the codes; FaultLog in reference/op_types.py).

Dimension letters: R rows, V vocabulary, W served width, Db draft slots.
"""

from __future__ import annotations

import torch

from reference.op_types import DraftRecord, FaultLog, SampleOut


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
