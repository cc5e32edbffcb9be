"""iquestrt/tp/peer_ring.py: the slot bookkeeping of the fused all-reduce's ring, with N ranks
emulated on one device (their rings are separate allocations; producers and consumers run one
after another): every consumer's tail over the peers' slots equals the tail over the stacked
partials bit for bit, and the ring's NaN state is what kernels/readiness.py's protocol says
after each step; a late producer is caught by the re-arm (failure flag), and without the re-arm
its stale slot would be consumed as fresh (the control). Concurrent: 2 and 3 gloo processes on
shared file mappings, producers delayed at random, the interpreted tails polling slots other
processes write; a rank that never writes ends every consumer of that step in the flag. On two
GPUs: the ring in symmetric memory, each rank an NCCL process reading its peer's slots."""

from __future__ import annotations

import pytest
import torch
import tp_workers
from tp_harness import (
    RING_HIDDEN,
    RING_LIVE,
    RING_ROWS,
    free_port,
    ring_partial,
    ring_tail_inputs,
    spawn,
)

from iquestrt.tp.group import TPGroup
from iquestrt.tp.peer_ring import PeerRing, symmetric_ring
from kernels.readiness import RingPolicy
from kernels.tails import moe_tail

NAN = float("nan")


def emulated(ranks: int, device, parts: int = 1) -> list[PeerRing]:
    views = [torch.full((3, parts, RING_ROWS, RING_HIDDEN), NAN, device=device)
             for _ in range(ranks)]
    return [PeerRing(views, q) for q in range(ranks)]


def tail(parts, t: int, flag, device, rearm=None, max_polls=3):
    h, w = (x.to(device) for x in ring_tail_inputs(t))
    n_live = torch.tensor([RING_LIVE[t]], dtype=torch.int32, device=device)
    polls = torch.zeros(RING_ROWS, dtype=torch.int32, device=device)
    out = moe_tail(parts, h, w, n_live, flag, eps=1e-6, ffn_out_scale=0.5, max_polls=max_polls,
                   rearm=rearm, polls=polls)
    return out.xn[: RING_LIVE[t]].cpu(), polls.cpu()


def stacked(ranks: int, t: int, device, parts: int = 1) -> torch.Tensor:
    """[N·S, R, H]: rank-major, a rank's S partials in order (the all-gather's layout)."""
    return torch.stack([ring_partial(10 * p + i, t) for p in range(ranks)
                        for i in range(parts)]).to(device)


@pytest.mark.parametrize("ranks,parts", [(2, 1), (3, 1), (2, 3)])
@pytest.mark.slow
def test_emulated_ranks_reduce_through_the_ring(ranks, parts, device):
    rings = emulated(ranks, device, parts)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for t, n in enumerate(RING_LIVE):
        for p, ring in enumerate(rings):
            for i in range(parts):
                ring.produce(t)[i, :n] = ring_partial(10 * p + i, t)[:n].to(device)
        want, _ = tail(stacked(ranks, t, device, parts), t, flag, device)
        for q, ring in enumerate(rings):
            got, polls = tail(ring.consume(t), t, flag, device, rearm=ring.rearm(t))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                f"step {t}, rank {q}: ring tail != stacked tail"
            assert polls.tolist() == [1] * RING_ROWS, (t, q, polls)
        assert flag.item() == 0
        for q, ring in enumerate(rings):
            views = ring.views[q].cpu()
            assert torch.isnan(views[(t - 1) % 3]).all(), f"step {t}: rank {q} not re-armed"
            assert not torch.isnan(views[t % 3][:, :n]).any(), f"step {t}: rank {q} erased"


@pytest.mark.slow
def test_a_late_producer_is_caught_and_without_rearm_consumed_stale(device):
    """Step 3 reuses step 0's slot. Rank 1 has not produced step 3 yet when rank 0 consumes:
    with the ring's re-arm rank 1's slot holds NaN, so rank 0 polls to its bound and raises the
    flag; a ring whose consumers never re-arm hands rank 0 step 0's values as step 3's."""
    for rearming in (True, False):
        rings = emulated(2, device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        for t in range(4):
            n = RING_LIVE[t]
            for p, ring in enumerate(rings):
                if (p, t) != (1, 3):
                    ring.produce(t)[0, :n] = ring_partial(10 * p, t)[:n].to(device)
            got, polls = tail(rings[0].consume(t), t, flag, device,
                              rearm=rings[0].rearm(t) if rearming else None)
            if t < 3:
                for ring in rings[1:]:  # rank 1 consumes too (and re-arms its own slot)
                    tail(ring.consume(t), t, flag, device,
                         rearm=ring.rearm(t) if rearming else None)
        want, _ = tail(stacked(2, 3, device), 3, torch.zeros_like(flag), device)
        if rearming:
            assert flag.item() == 1 and polls[: RING_LIVE[3]].tolist() == [3] * RING_LIVE[3]
            assert torch.isnan(got.float()).all()
        else:
            assert flag.item() == 0, "control: the stale slot was not even read as ready"
            assert not torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                "control: stale values gave the fresh result"


def test_ring_refusals(device):
    v = [torch.full((3, 2, 8, 128), NAN, device=device) for _ in range(2)]
    with pytest.raises(ValueError, match="unsafe"):
        PeerRing([x[:2] for x in v], 0, RingPolicy(buffers=2))
    with pytest.raises(ValueError, match=r"rank 2 outside \[0, 2\)"):
        PeerRing(v, 2)
    with pytest.raises(ValueError, match=r"views\[1\] has shape \(3, 2, 8, 64\)"):
        PeerRing([v[0], v[1][..., :64].contiguous()], 0)
    with pytest.raises(ValueError, match=r"views\[0\] has shape \(3, 8, 128\)"):
        PeerRing([x[:, 0] for x in v], 0)
    with pytest.raises(ValueError, match=r"views\[0\] must be contiguous fp32"):
        PeerRing([v[0].bfloat16(), v[1]], 0)
    with pytest.raises(ValueError, match="one view per rank"):
        PeerRing([], 0)
    with pytest.raises(ValueError, match="symmetric_ring: needs nccl ranks, got gloo"):
        symmetric_ring(TPGroup(0, 2, "gloo", torch.device("cpu"), 5.0), 8, 128)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_gloo_processes_reduce_through_shared_files(world, tmp_path):
    spawn(tp_workers.shared_ring_worker, world, (world, free_port(), str(tmp_path), 60.0, -1),
          240.0)
    for rank in range(world):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert res["flags"] == [0] * len(RING_LIVE), f"rank {rank}: flags {res['flags']}"
        for t, (got, want) in enumerate(zip(res["got"], res["want"], strict=True)):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                f"rank {rank}, step {t}: shared-ring tail != stacked tail"
    waited = [int(p[0]) for r in range(world)
              for p in torch.load(tmp_path / f"rank{r}.pt")["polls"]]
    print(f"\n  polls of row 0 per rank and step: {waited}")


@pytest.mark.slow
def test_a_rank_that_never_writes_ends_its_step_in_the_flag(tmp_path):
    spawn(tp_workers.shared_ring_worker, 2, (2, free_port(), str(tmp_path), 60.0, 4), 240.0)
    n = RING_LIVE[4]
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert res["flags"] == [0, 0, 0, 0, 1], f"rank {rank}: flags {res['flags']}"
        assert res["polls"][4][:n].tolist() == [50] * n
        assert torch.isnan(res["got"][4].float()).all()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one per NCCL rank)")
def test_symmetric_ring_on_two_gpus(tmp_path):
    spawn(tp_workers.peer_ring_worker, 2, (2, free_port(), str(tmp_path), 60.0), 240.0)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert res["flag"] == 0, f"rank {rank}: a readiness wait timed out"
        for t, (got, want) in enumerate(zip(res["got"], res["want"], strict=True)):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                f"rank {rank}, step {t}: peer-ring tail != stacked tail"
        print(f"\n  rank {rank}: polls per step (row 0) {[int(p[0]) for p in res['polls']]}")
