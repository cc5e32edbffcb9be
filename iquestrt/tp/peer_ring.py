"""The partial-buffer ring of the fused all-reduce over peer memory: each rank q
owns B slots P_q[0..B) of [S, R, H] FP32 (S partials per rank: the O projection's split-K
partials, or the experts' one) — in GPU symmetric memory, so that every peer can read them —
and at reduction step t

  producer(t) on q   writes its partial into P_q[t mod B]               (produce(t))
  consumer(t) on q   sums P_0 … P_{N−1}[t mod B] in rank order (each      (consume(t): the
                     rank's S partials in order), polling until NaN-free  PeerPartials of the
                     (kernels/readiness.py), then re-arms its own          slot; rearm(t))
                     P_q[(t − 1) mod B] (all S) with NaN

with lag 1 and B ≥ 3 slots (kernels/readiness.py proves the reuse safe and
tests/kernels/test_readiness.py checks it); B divides the ring's reductions per target forward
(`ring_buffers`), so every forward starts at slot 0 — what a captured round's fixed slots need.
A step with 0 live rows is empty (no poll, no re-arm): `TPRings.reset` arms every slot on every
rank, synchronized, before the next live step. The consumer is a tail kernel reading the peers'
slots through a table of addresses (kernels/peer_partials.py); one table per slot, made once, so
captured CUDA graphs replay them. Rank order in the table = rank order of the sum on every rank,
so every rank computes the same bits — and the bits of the all-gathered [N·S, R, H] partials
summed in that order (iquestrt/tp/model.py's gather path).

`symmetric_ring` allocates the ring in torch symmetric memory on a CUDA process group (one GPU
per rank; NVLink multicast stays off: iquestrt/tp/group.py). `shared_file_ring` is its CPU
stand-in for gloo ranks on one host: each rank's ring is a shared file mapping that every rank
maps too, so interpreted tails poll slots that other processes write, concurrently. `PeerRing`
itself takes any views [B, S, R, H] per rank (tests also emulate ranks on one device).

Dimension letters: B ring slots, N ranks, S partials per rank, R rows, H hidden.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.peer_partials import PeerPartials, RingRead
from kernels.readiness import RingPolicy


class PeerRing:
    def __init__(self, views, rank: int, policy: RingPolicy | None = None, keep=None,
                 emulated: int = 0):
        """views[p]: rank p's ring [B, S, R, H] fp32 as this rank addresses it (its own memory for
        p = rank, a peer mapping otherwise); keep: what must outlive the views (the symmetric
        memory handle); emulated: ranks with no process (the rank benchmark's TP8 rank on fewer
        GPUs) — each adds S zero partials in an allocation of its own after the real ranks',
        finite (always ready) and adding nothing, so their read traffic is paid."""
        self.policy = policy or RingPolicy()
        if not self.policy.safe:
            raise ValueError(f"PeerRing: policy {self.policy} is unsafe; need lag >= 1, buffers "
                             ">= lag + 2 and rearm_all_rows (kernels/readiness.py)")
        views = tuple(views)
        if not views:
            raise ValueError("PeerRing: expected one view per rank, got none")
        if not 0 <= rank < len(views):
            raise ValueError(f"PeerRing: rank {rank} outside [0, {len(views)})")
        b = self.policy.buffers
        for p, v in enumerate(views):
            if v.dim() != 4 or v.shape[0] != b or v.shape != views[0].shape:
                raise ValueError(f"PeerRing: views[{p}] has shape {tuple(v.shape)}; expected "
                                 f"[{b}, S, R, H] like views[0] {tuple(views[0].shape)}")
            if v.dtype != torch.float32 or not v.is_contiguous():
                raise ValueError(f"PeerRing: views[{p}] must be contiguous fp32, got {v.dtype}")
        if not isinstance(emulated, int) or not 0 <= emulated <= 64:
            raise ValueError(f"PeerRing: emulated ranks must be an int in [0, 64], got "
                             f"{emulated!r}")
        self.views, self.rank, self.keep = views, rank, keep
        self.emulated = [torch.zeros(views[0].shape[1:], device=views[0].device)
                         for _ in range(emulated)]  # E × [S, R, H], separate allocations
        ghost = [e[i] for e in self.emulated for i in range(e.shape[0])]
        self.slots = tuple(PeerPartials.of([v[s, i] for v in views for i in range(v.shape[1])]
                                           + ghost) for s in range(b))

    def produce(self, step: int) -> torch.Tensor:  # [S, R, H] this rank's slot of step t
        return self.views[self.rank][self.policy.read_slot(step)]

    def consume(self, step: int) -> PeerPartials:  # every rank's slot of step t, rank order
        return self.slots[self.policy.read_slot(step)]

    def rearm(self, step: int) -> torch.Tensor:  # [S, R, H] this rank's slot of step t − lag
        return self.views[self.rank][self.policy.rearm_slot(step)]

    def arm(self) -> None:
        """All of this rank's slots to NaN (start, or after a failure flag; every rank must
        arm, and synchronize, before any producer writes again)."""
        self.views[self.rank].fill_(float("nan"))


def _ring_shape(group, backend: str, where: str, why: str, policy, parts: int, rows: int,
                hidden: int):
    """→ (policy, ring shape [B, S, R, H]) once `group` is an initialized `backend` group."""
    if group.backend != backend:
        raise ValueError(f"{where}: needs {backend} ranks, got {group.backend} ({why})")
    group.require_initialized("tp.peer_ring")
    policy = policy or RingPolicy()
    return policy, (policy.buffers, parts, rows, hidden)


def symmetric_ring(group, rows: int, hidden: int, parts: int = 1,
                   policy: RingPolicy | None = None, emulated: int = 0) -> PeerRing:
    """A PeerRing in torch symmetric memory on `group` (an initialized NCCL TPGroup, one GPU per
    rank): collective — every rank calls it with the same shape. Armed and synchronized across
    ranks on return."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    policy, shape = _ring_shape(group, "nccl", "symmetric_ring", "peer memory is between CUDA "
                                "ranks; CPU ranks use shared_file_ring", policy, parts, rows,
                                hidden)
    buf = symm_mem.empty(*shape, dtype=torch.float32, device=group.device)
    buf.fill_(float("nan"))
    name = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required before rendezvous in 2.5–2.8
        symm_mem.enable_symm_mem_for_group(name)
    handle = symm_mem.rendezvous(buf, name)
    views = [buf if p == group.rank else handle.get_buffer(p, shape, torch.float32)
             for p in range(group.world)]
    torch.cuda.synchronize(group.device)
    dist.barrier()  # every rank armed before any producer of step 0 writes
    return PeerRing(views, group.rank, policy, keep=handle, emulated=emulated)


def shared_file_ring(group, rows: int, hidden: int, directory, name: str = "ring",
                     parts: int = 1, policy: RingPolicy | None = None,
                     emulated: int = 0) -> PeerRing:
    """A PeerRing of CPU ranks (gloo, one host) in shared file mappings DIRECTORY/NAME-rank<q>.bin
    (a directory every rank sees; the files stay until the caller removes the directory).
    Collective; armed and synchronized across ranks on return."""
    import torch.distributed as dist

    policy, shape = _ring_shape(group, "gloo", "shared_file_ring", "CUDA ranks use "
                                "symmetric_ring", policy, parts, rows, hidden)
    numel = policy.buffers * parts * rows * hidden
    files = [Path(directory) / f"{name}-rank{p}.bin" for p in range(group.world)]
    own = torch.from_file(str(files[group.rank]), shared=True, size=numel, dtype=torch.float32)
    own.fill_(float("nan"))
    dist.barrier()  # every file exists and is armed
    views = [own.view(shape) if p == group.rank else
             torch.from_file(str(f), shared=True, size=numel, dtype=torch.float32).view(shape)
             for p, f in enumerate(files)]
    return PeerRing(views, group.rank, policy, emulated=emulated)


class TPRings:
    """A TP target's two rings — O projections (S split-K partials per rank) and expert outputs
    (one per rank) — with their step counters: reduction steps in issue order, continuing
    across forwards and requests, the same on every rank since every rank runs the same layers.
    Each ring keeps the protocol on its own (its producer → consumer → next producer are stream
    ordered whatever runs in between). After a readiness failure the slots' state is unknown:
    `arm` on every rank, synchronized, before the next step."""

    def __init__(self, o: PeerRing, moe: PeerRing, max_polls: int, directory=None):
        self.o, self.moe, self.max_polls = o, moe, max_polls
        self.directory = directory  # the ring files' (CPU ranks); None in GPU memory
        self.o_step = self.moe_step = 0

    def next_o(self) -> torch.Tensor:  # [S, R, H]: where the next O projection writes
        return self.o.produce(self.o_step)

    def read_o(self) -> RingRead:
        """The attention tail's read of the step next_o was written for; advances the step."""
        t, self.o_step = self.o_step, self.o_step + 1
        return RingRead(self.o.consume(t), self.o.rearm(t), self.max_polls)

    def next_moe(self) -> torch.Tensor:  # [1, R, H]: where the next experts' output goes
        return self.moe.produce(self.moe_step)

    def read_moe(self) -> RingRead:
        t, self.moe_step = self.moe_step, self.moe_step + 1
        return RingRead(self.moe.consume(t), self.moe.rearm(t), self.max_polls)

    def arm(self) -> None:
        self.o.arm()
        self.moe.arm()
        self.o_step = self.moe_step = 0

    def reset(self, group) -> None:
        """Collective: arm every slot on every rank, with no read of a slot in flight before and
        no write after until all ranks armed. The TP engine calls it at each request's start and,
        with graphs, before its decode: a step with 0 live rows (a round after a request's end,
        graph capture's warm-up) re-arms nothing, and the next live step needs armed slots
        (kernels/readiness.py, "Empty steps")."""
        from iquestrt.tp.group import settle

        settle(group, "tp.peer_ring.reset (before arming)")
        self.arm()
        settle(group, "tp.peer_ring.reset (after arming)")


def ring_buffers(steps: int) -> int | None:
    """Slots B for a ring that takes `steps` reductions per target forward: the smallest
    divisor ≥ 3 of steps (3 = lag 1 + 2, the least safe ring), so every forward starts at slot 0
    and a captured round's fixed slots are the right ones at every replay; None when steps has
    no such divisor (fewer than 3 steps)."""
    return next((b for b in range(3, steps + 1) if steps % b == 0), None)


def make_rings(group, rows: int, hidden: int, o_parts: int, max_polls: int, o_steps: int,
               moe_steps: int, directory=None, emulated: int = 0) -> TPRings:
    """Both rings of a TP target, sized by ring_buffers of their steps per forward (3 when
    there is no divisor: eager launches only): symmetric memory on CUDA ranks, shared files on
    CPU ranks (in `directory`, or one rank 0 makes and removes at exit); `emulated` ranks as in
    PeerRing. Collective."""
    o_pol, moe_pol = (RingPolicy(buffers=ring_buffers(n) or 3) for n in (o_steps, moe_steps))
    if group.backend == "nccl":
        o = symmetric_ring(group, rows, hidden, o_parts, o_pol, emulated)
        moe = symmetric_ring(group, rows, hidden, 1, moe_pol, emulated)
        return TPRings(o, moe, max_polls)
    directory = directory or _shared_directory(group)
    o = shared_file_ring(group, rows, hidden, directory, "o", o_parts, o_pol, emulated)
    moe = shared_file_ring(group, rows, hidden, directory, "moe", 1, moe_pol, emulated)
    return TPRings(o, moe, max_polls, directory)


def _shared_directory(group) -> str:
    """A fresh directory made by rank 0 (removed when its process exits), named to every rank."""
    import atexit
    import shutil
    import tempfile

    import torch.distributed as dist

    name = [None]
    if group.rank == 0:
        name[0] = tempfile.mkdtemp(prefix="iquestrt-ring-")
        atexit.register(shutil.rmtree, name[0], ignore_errors=True)
    dist.broadcast_object_list(name, src=0)
    return name[0]
