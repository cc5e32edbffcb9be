"""Gate 8 — the NaN-readiness ring protocol (kernels/readiness.py), model-checked exhaustively.

The policy under check is the one the runtime's rings are built with: `RingPolicy()` (B buffers,
re-arm lag k), whose `read_slot` / `rearm_slot` are the slot math `PartialRing` indexes with. For
each case (N ranks, R rows, n_live per step, two steps per round: attention tail, MoE tail),
`kernels.readiness.explore` walks every interleaving of the ranks' producer row writes and whole
consumer kernels, breadth first with states deduplicated, and returns the shortest violating
trace: "stale" (a consumer took an old value as fresh) or "stuck" (a write was erased before
its read: a consumer waits forever). The gate fails with the first case's shortest bad
interleaving, op by op, with the slots each op touches.

What is checked is the schedule the slot functions produce, not `RingPolicy.safe`: that
predicate restates the argument's conditions on the fields (lag ≥ 1, B ≥ lag + 2, all rows
re-armed) and cannot see a slot function that disagrees with them; the evidence says when the
two disagree. The cases shrink and grow n_live across rounds, so a row that is padding in one
round is live in a later one (the all-rows re-arm, (4) of kernels/readiness.py). A final check
ties PartialRing to the policy: its produce / consume / re-arm views alias exactly the policy's
slots, so the model-checked slot math is the ring's.

Dimension letters: B buffers, N ranks, R rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.readiness import PartialRing, RingPolicy, explore


@dataclass(frozen=True)
class ReadinessCase:
    ranks: int  # N
    rows: int  # R
    rounds: tuple[int, ...]  # live rows of each round; a round is two steps

    @property
    def n_live(self) -> tuple[int, ...]:
        return tuple(n for n in self.rounds for _ in range(2))


@dataclass(frozen=True)
class ReadinessGateConfig:
    cases: tuple[ReadinessCase, ...] = (
        ReadinessCase(2, 3, (3, 1, 3)),
        ReadinessCase(3, 2, (2, 1, 2)),
        ReadinessCase(2, 2, (1, 2, 1, 2)),
        ReadinessCase(3, 3, (3, 1, 2, 3)),
        ReadinessCase(4, 2, (2, 1, 2)),
        ReadinessCase(2, 4, (4, 1, 4, 2)),
    )
    alias_steps: int = 12  # steps over which PartialRing's views are checked against the policy


def _trace_text(policy: RingPolicy, trace) -> str:
    """Ops in order; consecutive row writes of one producer are merged into one entry."""
    parts: list[str] = []
    rows: list[int] = []
    for i, (kind, rank, step, row) in enumerate(trace):
        if kind == "produce":
            rows.append(row)
            nxt = trace[i + 1] if i + 1 < len(trace) else None
            if nxt is None or nxt[:3] != (kind, rank, step):
                parts.append(f"produce(rank {rank}, step {step}, rows "
                             f"{','.join(map(str, rows))} → slot {policy.read_slot(step)})")
                rows = []
        else:
            parts.append(f"consume(rank {rank}, step {step}: reads slot "
                         f"{policy.read_slot(step)}, re-arms slot {policy.rearm_slot(step)})")
    return "; ".join(parts)


def _aliasing(policy: RingPolicy, g: ReadinessGateConfig) -> list[str]:
    """Problems where PartialRing's views are not the policy's slots (empty: none)."""
    try:
        ring = PartialRing(policy, ranks=2, rows=1, hidden=1)
    except ValueError as e:
        return [f"PartialRing refuses the policy: {e}"]
    base, slot_bytes = ring.buf.data_ptr(), ring.buf[0].nbytes
    rank_bytes = ring.buf[0, 0].nbytes

    def slot_of(view: torch.Tensor, rank: int | None) -> int:
        return (view.data_ptr() - base - (rank or 0) * rank_bytes) // slot_bytes

    bad = []
    for t in range(g.alias_steps):
        for q in range(2):
            got = (slot_of(ring.produce_view(t, q), q), slot_of(ring.consume_view(t), None),
                   slot_of(ring.rearm_view(t, q), q))
            want = (policy.read_slot(t), policy.read_slot(t), policy.rearm_slot(t))
            if got != want:
                bad.append(f"PartialRing step {t} rank {q}: (produce, consume, re-arm) slots "
                           f"{got}, policy says {want}")
    return bad[:1]


def run(
    g: ReadinessGateConfig | None = None, policy: RingPolicy | None = None
) -> tuple[bool, list[str]]:
    """(every case free of violations and PartialRing on the policy's slots, evidence)."""
    g = g or ReadinessGateConfig()
    policy = policy or RingPolicy()
    evidence = []
    for case in g.cases:
        v = explore(policy, case.ranks, case.rows, case.n_live)
        if v is None:
            continue
        claim = " (RingPolicy.safe claims it safe)" if policy.safe else ""
        steps = _trace_text(policy, v.trace)
        evidence.append(
            f"{v.kind} after {len(v.trace)} ops (N={case.ranks}, R={case.rows}, n_live per "
            f"step {case.n_live}): {steps}; {v.detail}; policy {policy}{claim}"
        )
        break
    evidence += _aliasing(policy, g)
    ok = not evidence
    if ok:
        evidence.append(
            f"{policy}: {len(g.cases)} cases (N 2–4, R 2–4, n_live shrinking and growing "
            f"across rounds), every interleaving free of stale reads and lost writes; "
            f"PartialRing's views on the policy's slots over {g.alias_steps} steps"
        )
    return ok, evidence
