"""NaN readiness for rank-partial reductions, and the ring of partial buffers it needs.

A partial buffer holds NaN until its producer writes it, so the read that sums the partials also
tells whether they are all there: a NaN anywhere in the sum means "not yet". Consumers poll a
bounded number of times and raise a failure flag instead of spinning forever.

Ring protocol (the argument; `ProtocolSim` below models it and tests/kernels/test_readiness.py
checks it exhaustively on small cases and with hypothesis-drawn schedules on the real kernels).

  Steps t = 0, 1, 2, … number every reduction in issue order — attention tail, MoE tail, the next
  layer's attention tail, …, across rounds. Each of the N ranks q owns B partial buffers
  P_q[0..B) of [R, H]. Producer(t) on rank q (o_proj, or the experts' down projection) writes
  the live rows of P_q[t mod B]; consumer(t) on every rank reads the live rows of P_p[t mod B]
  for all p and, once its read is complete and NaN-free, re-arms its own P_q[(t − k) mod B] —
  all R rows — with NaN. Assumption: on each rank the kernels of consecutive steps are stream-
  ordered, producer(t) → consumer(t) → producer(t + 1), with no overlap (no PDL) across them.

  (1) A re-arm never erases a value still to be read. Consumer(t) on q passed readiness, so every
      rank p wrote its step-t partial; producer(t) on p started after consumer(t − 1) on p ended.
      Hence all ranks finished every read of steps ≤ t − 1, and lag k ≥ 1 re-arms such a step.
      k = 0 re-arms the buffer being read: a slower rank (or another program of the same kernel)
      then sees NaN and times out.
  (2) A re-arm never erases a fresh value. The next write into P_q[(t − k) mod B] is
      producer(t − k + B) on q itself, after consumer(t) on q in stream order iff B ≥ k + 1.
  (3) A consumer never takes a stale value for a fresh one. Consumer(t') on p reads P_q[t' mod B];
      its previous content (step t' − B) was re-armed by consumer(t' − B + k) on q. Consumer(t')
      on p started only after p saw q's step-(t' − 1) partial, written by producer(t' − 1) on q
      after consumer(t' − 2) on q ended. So B ≥ k + 2 orders the re-arm first. With B = k + 1 a
      slow q has not re-armed yet: p finds q's step-(t' − B) values, no NaN, and consumes them.
      (Across GPUs the NaN stores and the producer's stores go to q's memory in q's stream order;
      remote reads are served from q's L2, so p sees the NaN, not the older value.)
  (4) All R rows are re-armed, not only the live ones: a row padded in one round and live again
      in a later round would otherwise still hold an old value (case (3) across rounds).

  So lag k = 1 and B = 3 buffers per ring, the minimum. Steps keep counting across rounds: a
  captured graph replays fixed slots, so the reductions one round puts on a ring must be a
  multiple of B (87 target layers × 2 tails = 174 = 58·3), or the slot base must come from a
  device counter. After any failure flag the state of the ring is unknown: synchronize and
  `reset()` it (and the router scratch of kernels/tails.py).
  Empty steps. A step with 0 live rows (rounds after the request's end, graph capture's warm-up)
  writes, reads and re-arms nothing, so the slot its consumer would have re-armed keeps the
  previous step's values: a live step B − 1 later could take them for fresh (case (3)). So an
  empty step must be followed by an arm of every slot on every rank, synchronized, before the
  next live step — the TP engine arms its rings at every request's start and before its decode
  (iquestrt/tp/peer_ring.py TPRings.reset); `explore(..., arm_after_empty=...)` checks both
  ways.
  The re-arm runs inside the consumer kernel, after its readiness poll: that poll is the evidence
  (1) needs, and a separate re-arm kernel would add one kernel boundary per reduction (≈0.9 µs in
  a CUDA graph, two per layer) for the same ordering.

Dimension letters: B ring buffers, N ranks (partials), R rows, H hidden.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# --- protocol -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RingPolicy:
    buffers: int = 3  # B
    lag: int = 1  # k: consumer(t) re-arms its own buffer of step t − k
    rearm_all_rows: bool = True  # re-arm all R rows, not only the consumer's live rows

    def read_slot(self, step: int) -> int:
        return step % self.buffers

    def rearm_slot(self, step: int) -> int:
        return (step - self.lag) % self.buffers

    @property
    def safe(self) -> bool:
        """(1)–(4) of the module docstring; the simulator confirms it case by case."""
        return self.lag >= 1 and self.buffers >= self.lag + 2 and self.rearm_all_rows


@dataclass(frozen=True)
class Violation:
    kind: str  # "stale" (an old value consumed as fresh) | "stuck" (a lost write: waits forever)
    detail: str
    trace: tuple[tuple[str, int, int, int], ...]  # (op, rank, step, row; −1 for consume)


class ProtocolSim:
    """Pure-Python model of the ring. Element state per (slot, rank, row): None = NaN, else the
    step whose producer wrote it. A producer writes its live rows one at a time, in any order
    (other ranks may read in between); a consume is atomic: enabled only when no live row of any
    rank is NaN, it reads them all, then re-arms. Stream order per rank: produce(t) (all rows),
    consume(t), produce(t + 1), …"""

    def __init__(self, policy: RingPolicy, ranks: int, rows: int):
        self.policy, self.ranks, self.rows = policy, ranks, rows
        self.state: dict[tuple[int, int, int], int | None] = {
            (s, q, r): None
            for s in range(policy.buffers) for q in range(ranks) for r in range(rows)
        }

    def key(self) -> tuple:
        return tuple(self.state[k] for k in sorted(self.state))

    def ready(self, step: int, n_live: int) -> bool:
        s = self.policy.read_slot(step)
        return all(self.state[s, q, r] is not None
                   for q in range(self.ranks) for r in range(n_live))

    def produce(self, rank: int, step: int, row: int) -> None:
        self.state[self.policy.read_slot(step), rank, row] = step

    def consume(self, rank: int, step: int, n_live: int) -> str | None:
        s = self.policy.read_slot(step)
        stale = [(q, r, self.state[s, q, r]) for q in range(self.ranks) for r in range(n_live)
                 if self.state[s, q, r] != step]
        a = self.policy.rearm_slot(step)
        # a kernel knows only this step's n_live: the unsafe variant re-arms those rows; an
        # empty step (n_live = 0) re-arms nothing (kernels' ready_row)
        rearmed = self.rows if self.policy.rearm_all_rows else n_live
        for r in range(rearmed if n_live > 0 else 0):
            self.state[a, rank, r] = None
        if stale:
            return (f"consumer({step}) on rank {rank} took (rank, row, written at step) "
                    f"{stale[:3]} as fresh")
        return None


def explore(
    policy: RingPolicy, ranks: int, rows: int, n_live: tuple[int, ...],
    arm_after_empty: bool = False,
) -> Violation | None:
    """Breadth-first over every interleaving of the ranks' ops for steps 0..len(n_live)−1
    (n_live[t] live rows at step t; 0 = an empty step: no writes, no poll, no re-arm); the
    shortest violating trace, or None. arm_after_empty: before a live step that follows an
    empty one, every rank waits until all ranks got there, then all slots are armed (NaN)."""
    steps = len(n_live)

    def phase(t: int) -> tuple[int, tuple[int, ...]]:  # start of step t: produce its live rows
        if t == steps:
            return 2 * steps, ()
        return (2 * t, tuple(range(n_live[t]))) if n_live[t] else (2 * t + 1, ())

    def gated(t: int) -> bool:  # live step t after an empty one, behind the synchronized arm
        return arm_after_empty and 0 < t < steps and n_live[t] > 0 and n_live[t - 1] == 0

    start = ProtocolSim(policy, ranks, rows)
    begin = tuple(phase(0) for _ in range(ranks))
    queue = deque([(begin, start.state, (), frozenset())])
    seen = {(begin, start.key(), frozenset())}
    while queue:
        pcs, state, trace, armed = queue.popleft()
        nodes = []
        at = {pc for pc, _ in pcs}
        t_all = next(iter(at)) // 2 if len(at) == 1 else None
        if (t_all is not None and next(iter(at)) % 2 == 0 and gated(t_all)
                and t_all not in armed):  # every rank at the barrier: arm all slots
            sim = ProtocolSim(policy, ranks, rows)
            nodes.append((pcs, sim.state, trace + (("arm", -1, t_all, -1),), armed | {t_all}))
        for q, (pc, todo) in enumerate(pcs):
            if pc == 2 * steps:
                continue
            t, is_consume = divmod(pc, 2)
            if not is_consume and gated(t) and t not in armed:
                continue  # waiting at the barrier
            sim = ProtocolSim(policy, ranks, rows)
            sim.state = dict(state)
            if is_consume:
                if not sim.ready(t, n_live[t]):
                    continue
                op = ("consume", q, t, -1)
                err = sim.consume(q, t, n_live[t])
                if err:
                    return Violation("stale", err, trace + (op,))
                new = pcs[:q] + (phase(t + 1),) + pcs[q + 1:]
                nodes.append((new, sim.state, trace + (op,), armed))
                continue
            for row in todo:
                sim = ProtocolSim(policy, ranks, rows)
                sim.state = dict(state)
                sim.produce(q, t, row)
                left = tuple(r for r in todo if r != row)
                nxt = (pc, left) if left else (pc + 1, ())
                new = pcs[:q] + (nxt,) + pcs[q + 1:]
                nodes.append((new, sim.state, trace + (("produce", q, t, row),), armed))
        for new, st, tr, arm in nodes:
            key = (new, tuple(st[k] for k in sorted(st)), arm)
            if key not in seen:
                seen.add(key)
                queue.append((new, st, tr, arm))
        if not nodes and any(pc < 2 * steps for pc, _ in pcs):
            waiting = [q for q, (pc, _) in enumerate(pcs) if pc < 2 * steps]
            return Violation("stuck", f"ranks {waiting} wait forever at {pcs}", trace)
    return None


class PartialRing:
    """B partial buffers of N ranks on one device, [B, N, R, H], NaN until written, with the slot
    math of `policy`. Under tensor parallelism each rank owns only its [B, R, H] and the tails
    read its peers' through a table of addresses: iquestrt/tp/peer_ring.py."""

    def __init__(self, policy: RingPolicy, ranks: int, rows: int, hidden: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if not policy.safe:
            raise ValueError(
                f"PartialRing: policy {policy} is unsafe; need lag >= 1, buffers >= lag + 2 and "
                "rearm_all_rows (kernels/readiness.py explains why)"
            )
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"PartialRing: dtype must be float32 or bfloat16, got {dtype}")
        self.policy = policy
        self.buf = torch.full((policy.buffers, ranks, rows, hidden), float("nan"),
                              dtype=dtype, device=device)  # [B, N, R, H]

    def produce_view(self, step: int, rank: int) -> torch.Tensor:  # [R, H]
        return self.buf[self.policy.read_slot(step), rank]

    def consume_view(self, step: int) -> torch.Tensor:  # [N, R, H]
        return self.buf[self.policy.read_slot(step)]

    def rearm_view(self, step: int, rank: int) -> torch.Tensor:  # [R, H]
        return self.buf[self.policy.rearm_slot(step), rank]

    def reset(self) -> None:
        self.buf.fill_(float("nan"))


# --- @triton.jit helpers (used by kernels/tails.py) ---------------------------------------------


@triton.jit
def partial_base(ptr, n, stride_n, TABLE: tl.constexpr, PART_BF16: tl.constexpr):
    """Partial n's base: ptr + n·stride_n, or with TABLE the n-th int64 address of the table at
    ptr (kernels/peer_partials.py: buffers at unrelated addresses, e.g. peer GPUs')."""
    if TABLE:
        addr = tl.load(ptr + n)
        if PART_BF16:
            base = addr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
        else:
            base = addr.to(tl.pointer_type(tl.float32), bitcast=True)
    else:
        base = ptr + n * stride_n
    return base


@triton.jit
def wait_partial_sum(ptr, stride_n, row_off, offs, mask, max_polls, NPART: tl.constexpr,
                     TABLE: tl.constexpr, PART_BF16: tl.constexpr):
    """Σ_{n<NPART} partial_n[row_off + offs] in FP32, n = 0, 1, … in order (partial_n as
    partial_base), re-read (volatile: not served from a cache that misses other producers'
    writes) until the sum has no NaN or max_polls reads were made. → (sum, ready int32 0/1,
    polls made)."""
    polls = tl.full([], 0, tl.int32)
    ready = tl.full([], 0, tl.int32)
    acc = tl.zeros(offs.shape, tl.float32)
    while (ready == 0) & (polls < max_polls):
        first = partial_base(ptr, 0, stride_n, TABLE, PART_BF16) + row_off
        acc = tl.load(first + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
        for n in tl.static_range(1, NPART):
            base = partial_base(ptr, n, stride_n, TABLE, PART_BF16) + row_off
            part = tl.load(base + offs, mask=mask, other=0.0, volatile=True)
            acc = acc + part.to(tl.float32)
        ready = (tl.sum((acc != acc).to(tl.int32), axis=None) == 0).to(tl.int32)
        polls += 1
    return acc, ready, polls


@triton.jit
def wait_ready(ptrs, mask, max_polls):
    """One NaN-armed tensor: re-read (volatile) until NaN-free or max_polls reads. → (x, ready)."""
    polls = tl.full([], 0, tl.int32)
    ready = tl.full([], 0, tl.int32)
    x = tl.zeros(ptrs.shape, tl.float32)
    while (ready == 0) & (polls < max_polls):
        x = tl.load(ptrs, mask=mask, other=0.0, volatile=True).to(tl.float32)
        ready = (tl.sum((x != x).to(tl.int32), axis=None) == 0).to(tl.int32)
        polls += 1
    return x, ready


@triton.jit
def wait_count(ptr, target, max_polls):
    """Spin (volatile reads) until the int32 counter *ptr reaches target or max_polls reads,
    then one acquire read (an atomic add of 0, which compiles to ld.global.gpu.acquire): the
    loads after it see whatever the counted producers stored before their release increment
    (kernels/tails.py, the router's input). → ready (int32 0/1)."""
    polls = tl.full([], 0, tl.int32)
    seen = tl.load(ptr, volatile=True)
    while (seen < target) & (polls < max_polls):
        seen = tl.load(ptr, volatile=True)
        polls += 1
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    return (seen >= target).to(tl.int32)


@triton.jit
def ready_row(part_ptr, stride_pn, stride_pr, rearm_ptr, stride_an, stride_ar, polls_ptr,
              flag_ptr, row, n, cols, cmask, max_polls,
              NPART: tl.constexpr, REARM: tl.constexpr, WRITE_POLLS: tl.constexpr,
              TABLE: tl.constexpr, PART_BF16: tl.constexpr, REARM_PARTS: tl.constexpr):
    """Prologue of a consumer's row program: wait for Σ partials of `row`, raise the flag on a
    timeout, re-arm this row of `rearm` (each of its REARM_PARTS buffers) once ready.
    → (FP32 sum [BLOCK_H], ready, live).
    A padding row (row ≥ n) with re-arming polls row 0 instead: it needs the evidence that this
    step's producers ran, not the data. Without re-arming a padding row has nothing to wait for:
    it makes no poll and raises no flag. A step with n = 0 is empty either way — a round after
    the request finished (iquestrt/round.py), or graph capture's warm-up: nobody writes, so
    nobody polls, re-arms or raises the flag; the ring must be armed again (every rank,
    synchronized) before its next live step (module docstring, "Empty steps")."""
    live = row < n
    src = tl.where(live, row, 0)
    if REARM:
        budget = tl.where(n > 0, max_polls, 0)
    else:
        budget = tl.where(live, max_polls, 0)
    acc, ready, polls = wait_partial_sum(part_ptr, stride_pn, src * stride_pr, cols, cmask,
                                         budget, NPART, TABLE, PART_BF16)
    if WRITE_POLLS:
        tl.store(polls_ptr + row, polls)
    fail = ready == 0
    if REARM:
        fail = fail & (n > 0)
    else:
        fail = fail & live
    tl.store(flag_ptr, 1, mask=fail)
    if REARM:  # REARM_PARTS buffers [R, H] stride_an apart (a rank's split-K partials)
        nan = tl.full(cols.shape, float("nan"), tl.float32).to(rearm_ptr.dtype.element_ty)
        for i in tl.static_range(REARM_PARTS):
            tl.store(rearm_ptr + i * stride_an + row * stride_ar + cols, nan,
                     mask=cmask & (ready != 0))
    return acc, ready, live
