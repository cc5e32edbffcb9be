"""`bench round --tp N` (benchmarks/rank/tp.py): the rank ops read a real ring of N ranks plus
emulated ones; two gloo processes run a sweep through it in step."""

from __future__ import annotations

import json
import os

import pytest
import torch
import tp_workers
from tp_harness import free_port, spawn

from benchmarks.rank.ops import make_rank_ops
from benchmarks.rank.shapes import small_rank_config
from benchmarks.rank.traces import uniform_table
from benchmarks.rank.weights import random_weights
from iquestrt.ops import Live
from iquestrt.tp.peer_ring import PeerRing, TPRings
from kernels.linear import linear_fp8_splits
from kernels.readiness import RingPolicy
from kernels.tails import moe_tail

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="interpreted kernels on CPU tensors (TRITON_INTERPRET off)")
CFG = small_rank_config()


def _rings(weights, emulated: int) -> tuple[TPRings, list[torch.Tensor], list[torch.Tensor]]:
    """Rank 0 of two ranks emulated in one process: (rings, rank views of O, of MoE)."""
    h = CFG.target.hidden_size
    s = linear_fp8_splits(*weights.layers[0].attn.o.w.shape)
    o = [torch.full((4, s, 8, h), float("nan")) for _ in range(2)]
    m = [torch.full((3, 1, 8, h), float("nan")) for _ in range(2)]
    rings = TPRings(PeerRing(o, 0, RingPolicy(buffers=4), emulated=emulated),
                    PeerRing(m, 0, RingPolicy(buffers=3), emulated=emulated), max_polls=4)
    return rings, o, m


@interpreted
@pytest.mark.slow
def test_ring_ops_read_every_real_rank_and_the_emulated_ones():
    """The O projection writes this rank's slot and the tail reads 2·S real partials then
    6·S emulated zeros; the peer's slot is summed in (changing it changes the result) and a
    peer that never wrote ends in the flag."""
    weights = random_weights(CFG, "cpu", 0, 256)
    rings, o, _ = _rings(weights, emulated=6)
    t = CFG.target
    table = uniform_table(8, t.num_hidden_layers - 1, 8, t.num_experts, t.num_experts_per_tok,
                          0).ids
    ops = make_rank_ops("kernels", "cpu", 4, weights, 8, table, reduce="ring", rings=rings)
    layer = weights.layers[2]
    s = o[0].shape[1]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, layer.attn.o.w.shape[1], generator=g).bfloat16()
    live = Live.of(4, "cpu")
    read = ops.linear_fp8_partials(x, layer.attn.o, live)
    assert len(read.partials.buffers) == 8 * s
    assert read.partials.buffers[0].data_ptr() == o[0][0, 0].data_ptr()
    assert read.partials.buffers[s].data_ptr() == o[1][0, 0].data_ptr()
    assert all(torch.count_nonzero(b) == 0 for b in read.partials.buffers[2 * s:])
    h = torch.randn(8, t.hidden_size, generator=g).bfloat16()
    w = torch.ones(t.hidden_size, dtype=torch.bfloat16)

    def tail(partials, rearm=None):
        flag = torch.zeros(1, dtype=torch.int32)
        out = moe_tail(partials, h, w, live.t, flag, eps=1e-6, ffn_out_scale=1.0, max_polls=4,
                       rearm=rearm).xn[:4]
        return out, int(flag.item())

    _, flag = tail(read.partials)
    assert flag == 1  # rank 1 has not written its slot of this step
    o[1][0].copy_(o[0][0])
    both, flag = tail(read.partials, read.rearm)
    assert flag == 0 and torch.isnan(read.rearm).all()
    alone, _ = tail(torch.cat([o[0][0], torch.zeros_like(o[0][0])]))
    assert not torch.equal(both.float(), alone.float())  # the peer's partials are in the sum
    doubled, _ = tail(torch.cat([o[0][0], o[0][0]]))
    assert torch.equal(both.view(torch.int16), doubled.view(torch.int16))
    with pytest.raises(ValueError, match="rings are given exactly with reduce 'ring'"):
        make_rank_ops("kernels", "cpu", 4, weights, 8, table, reduce="table", rings=rings)


def test_emulated_ranks_are_validated():
    views = [torch.zeros(3, 1, 2, 4)]
    with pytest.raises(ValueError, match="emulated ranks must be an int in \\[0, 64\\]"):
        PeerRing(views, 0, emulated=-1)
    assert len(PeerRing(views, 0, emulated=3).slots[0].buffers) == 4


@interpreted
@pytest.mark.slow
def test_two_processes_run_the_sweep_through_the_ring(tmp_path):
    spawn(tp_workers.bench_round_worker, 2, (2, free_port(), str(tmp_path), 120.0), 900.0)
    r = [torch.load(tmp_path / f"rank{q}.pt", weights_only=False) for q in range(2)]
    for q in range(2):
        assert [c.get("error") for c in r[q]["configs"]] == [None], r[q]["configs"]
        assert r[q]["tp"]["world"] == 2 and r[q]["tp"]["emulated"] == 6
    assert r[0]["tp"] == r[1]["tp"]  # every rank's round times, gathered on every rank
    assert len(r[0]["tp"]["rank_round_s"]) == 2
    shapes = [c["shape"] for c in r[0]["configs"]], [c["shape"] for c in r[1]["configs"]]
    assert shapes[0] == shapes[1]  # the same rounds on both ranks
    rec = json.loads((tmp_path / "rec" / "record.json").read_text())  # rank 0 alone writes it
    assert rec["tp"]["world"] == 2
    assert "## Tensor parallelism: 2 processes (gloo), real ring" in \
        (tmp_path / "rec" / "summary.md").read_text()
