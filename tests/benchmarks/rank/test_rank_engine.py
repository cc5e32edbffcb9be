"""The benchmark's engine on the twins at a small rank (benchmarks/rank/shapes.py): synthetic
prefill, rounds end to end through the engine's own path, peer partials read without changing
a bit, routing taken from the trace table."""

import os

import pytest
import torch

from benchmarks.rank.engine import RankEngine, fill_cache
from benchmarks.rank.shapes import small_rank_config
from benchmarks.rank.traces import uniform_table
from benchmarks.rank.weights import random_weights
from iquestrt.config import RuntimeConfig
from iquestrt.engine import EngineError
from iquestrt.ops import Live, TwinOps
from iquestrt.snapshot import caches_digest
from kernels.peer_partials import RingRead
from kernels.tails import moe_tail
from reference.depth import FixedDepth
from reference.kv_layout import EMPTY, KVLayout, LayerKV

CFG = small_rank_config()
# the interpreted kernels on CPU tensors; a GPU host runs the table path compiled in the rank bench
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="interpreted kernels on CPU tensors (TRITON_INTERPRET off)")
CONTEXT = 150  # beyond a sliding ring (32 + 64 slots): the rings have wrapped


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, "cpu", 0, 512)


def _table(steps=32, seed=0):
    t = CFG.target
    return uniform_table(steps, t.num_hidden_layers - 1, 8, t.num_experts, t.num_experts_per_tok,
                         seed).ids


def _engine(weights, table, peers=7, depth=3):
    rc = RuntimeConfig(ops="twins", device="cpu", max_width=8, ring_pad=64, max_positions=512,
                       policy=FixedDepth(depth), prefetch=False)
    return RankEngine(weights, rc, table, seed=1, peers=peers)


def test_fill_cache_labels_what_a_prefill_leaves():
    g = torch.Generator().manual_seed(0)
    full = LayerKV.empty(KVLayout.make_full(64, 1, 8))
    fill_cache(full, 40, g)
    assert full.slot_pos[:40].tolist() == list(range(40))
    assert (full.slot_pos[40:] == EMPTY).all() and (full.k[40:] == 0).all()
    assert torch.isfinite(full.k[:40].float()).all() and full.k[:40].float().std() > 0.5
    ring = LayerKV.empty(KVLayout.make_ring(16, 8, 1, 8, start=1))
    fill_cache(ring, 50, g)
    assert sorted(ring.slot_pos.tolist()) == list(range(26, 50))  # the last 24 positions
    assert all(int(ring.slot_pos[p % 24]) == p for p in range(26, 50))
    young = LayerKV.empty(KVLayout.make_ring(16, 8, 1, 8, start=1))
    fill_cache(young, 5, g)  # a draft ring starts at position 1
    assert sorted(p for p in young.slot_pos.tolist() if p != EMPTY) == [1, 2, 3, 4]


@pytest.mark.slow
def test_rounds_run_end_to_end(weights):
    eng = _engine(weights, _table())
    res = eng.generate(eng.request(CONTEXT, 6))
    assert len(res.rounds) >= 1 and len(res.tokens) == 6
    assert all(0 <= tok < CFG.target.vocab_size for tok in res.tokens)
    assert all(len(r.drafts) == 3 for r in res.rounds)
    assert res.rounds[0].position == CONTEXT  # the first round starts after the context
    assert eng.timing.rounds == len(res.rounds)
    assert eng.ops.steps_taken() == len(res.rounds)  # one table step per target forward
    c = eng.session.caches
    assert c.target_len == CONTEXT + len(res.tokens) - 1


@pytest.mark.slow
def test_peer_partials_are_read_and_change_no_bit(weights):
    digests, tokens = [], []
    for peers in (7, 0):
        eng = _engine(weights, _table(), peers=peers)
        tokens.append(eng.generate(eng.request(CONTEXT, 4)).tokens)
        digests.append(caches_digest(eng.session.caches))
    assert tokens[0] == tokens[1] and digests[0] == digests[1]
    # the comparison is sensitive: a finite non-zero peer changes the caches' bits
    eng = _engine(weights, _table())
    for buf in eng.ops.attn_buf.values():
        buf[-1].fill_(1e-3)
    eng.generate(eng.request(CONTEXT, 4))
    assert caches_digest(eng.session.caches) != digests[0]


def test_a_poisoned_peer_raises_the_layers_readiness_flag(weights):
    eng = _engine(weights, _table())
    eng.ops.moe_buf[5][3].fill_(float("nan"))  # layer 5's MoE tail, peer 3
    with pytest.raises(EngineError, match="readiness failure flag raised by target layer 5"):
        eng.generate(eng.request(CONTEXT, 4))


def _spy_moe(monkeypatch):
    seen = []
    real = TwinOps.moe

    def moe(self, x, weights, ids, m, live, out_dtype, xq=None, out=None):
        if out_dtype == torch.float32:  # the target's MoE (the draft's is bf16)
            seen.append(ids[: live.n].long().clone())
        return real(self, x, weights, ids, m, live, out_dtype, xq=xq, out=out)

    monkeypatch.setattr(TwinOps, "moe", moe)
    return seen


@pytest.mark.parametrize("with_table", [True, False])
@pytest.mark.slow
def test_experts_follow_the_table(weights, monkeypatch, with_table):
    table = _table(steps=5, seed=2)
    seen = _spy_moe(monkeypatch)
    eng = _engine(weights, table if with_table else None, depth=2)
    res = eng.generate(eng.request(CONTEXT, 4))
    n_moe = CFG.target.num_hidden_layers - 1
    assert len(seen) == n_moe * len(res.rounds)
    follows = all(torch.equal(seen[i * n_moe + l], table[i % 5, l, :3].long())
                  for i in range(len(res.rounds)) for l in range(n_moe))
    assert follows == with_table  # without a table the router's ids differ (the check can fail)


@interpreted
@pytest.mark.slow
def test_the_table_read_changes_no_bit(weights):
    """reduce "table" (interpreted kernels): the o_proj override hands the tail a RingRead of the
    same S + 7 partials (local slots aliased, peers in their own allocations) and the MoE tail is
    redirected to the expert buffer's read; summed through the table they give the stacked
    read's bits and re-arm the spare slot; a finite non-zero peer in the table's copy changes
    them (the table is what is read)."""
    rc = RuntimeConfig(ops="kernels", device="cpu", max_width=8, ring_pad=64, max_positions=512,
                       policy=FixedDepth(1), prefetch=False)
    ops = RankEngine(weights, rc, _table(), seed=1, reduce="table").ops
    layer = weights.layers[3]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, layer.attn.o.w.shape[1], generator=g).bfloat16()
    live = Live.of(5, "cpu")
    read = ops.linear_fp8_partials(x, layer.attn.o, live)
    buf = ops.attn_buf[3]
    local = buf.shape[0] - 7
    assert isinstance(read, RingRead) and len(read.partials.buffers) == local + 7
    assert [b.data_ptr() for b in read.partials.buffers[:local]] == \
        [buf[s].data_ptr() for s in range(local)]
    h = torch.randn(8, CFG.target.hidden_size, generator=g).bfloat16()
    w = torch.ones(CFG.target.hidden_size, dtype=torch.bfloat16)
    flag = torch.zeros(1, dtype=torch.int32)

    def tail(parts, rearm=None):
        return moe_tail(parts, h, w, live.t, flag, eps=1e-6, ffn_out_scale=1.0, max_polls=2,
                        rearm=rearm).xn[:5]

    want = tail(buf)
    assert torch.equal(tail(read.partials, read.rearm).view(torch.int16), want.view(torch.int16))
    assert torch.isnan(read.rearm).all() and flag.item() == 0
    moe_buf = ops.moe_buf[3]
    moe_buf[0].copy_(buf[0])
    via_ops = ops.moe_tail(moe_buf[0][None], h, w, live, flag, eps=1e-6, ffn_out_scale=1.0)
    ops.reads[moe_buf.data_ptr()].partials.buffers[-1].fill_(1e-3)
    poked = ops.moe_tail(moe_buf[0][None], h, w, live, flag, eps=1e-6, ffn_out_scale=1.0)
    assert not torch.equal(poked.xn[:5].float(), via_ops.xn[:5].float())
    read.partials.buffers[-1].fill_(1e-3)
    assert not torch.equal(tail(read.partials).float(), want.float())
    with pytest.raises(ValueError, match="reduce 'table': the twins read partials"):
        _engine(weights, _table()).ops.attach(weights, 8, None, reduce="table")


@interpreted
@pytest.mark.slow
def test_table_reads_pass_a_zero_live_warm_up(weights):
    """Graph capture warms up with 0 live rows. A re-arming tail's step with 0 live rows is
    empty — no poll, no re-arm, no flag (kernels/readiness.py) — so fresh table reads, whose
    local slots are still NaN, pass it (a polling warm-up raises the flag at round 0 of every
    graphed run: reports/benchmarks/h200-2026-11-30/session7/rank_table_call2_failed.log); one
    live row on the same slots does raise it."""
    rc = RuntimeConfig(ops="kernels", device="cpu", max_width=8, ring_pad=64, max_positions=512,
                       policy=FixedDepth(1), prefetch=False)
    ops = RankEngine(weights, rc, _table(), seed=1, reduce="table").ops
    h = torch.zeros(8, CFG.target.hidden_size, dtype=torch.bfloat16)
    w = torch.ones(CFG.target.hidden_size, dtype=torch.bfloat16)

    def flag_after(read, live):
        flag = torch.zeros(1, dtype=torch.int32)
        moe_tail(read.partials, h, w, Live.of(live, "cpu").t, flag, eps=1e-6,
                 ffn_out_scale=1.0, max_polls=2, rearm=read.rearm)
        return flag.item()

    reads = list(ops.reads.values())
    assert len(reads) == len(ops.attn_buf) + len(ops.moe_buf)
    assert torch.isnan(reads[0].partials.buffers[0]).all()  # unwritten local slot
    assert [flag_after(r, 0) for r in reads] == [0] * len(reads)
    assert flag_after(reads[0], 1) == 1
