"""Bit-exactness of the device-resident engine's scheduling variants on the GPU (compiled
kernels): graph replay vs eager launches, reading the log every round vs every 8 rounds (then
rounds launched after the request finished must commit nothing), padded width 8 vs exact width.
Each pair must agree on tokens, round records (drafts, q(y), entropies, acceptance) and a digest
of every cache after the request. A broken variant shows the digest is sensitive."""

from __future__ import annotations

from pathlib import Path

import pytest

from iquestrt.config import RuntimeConfig
from iquestrt.engine import Engine
from iquestrt.snapshot import caches_digest
from iquestrt.weights import from_checkpoint
from reference.checkpoint import load_checkpoint
from reference.depth import FixedDepth
from reference.speculative import GenerationRequest
from tests.helpers.engine_setup import GREEDY, SAMPLING, make_ckpt, rounds_key

pytestmark = pytest.mark.gpu
PROMPT = (5, 17, 300, 22, 9, 411, 78, 150, 3, 64, 200)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return load_checkpoint(make_ckpt(tmp_path_factory.mktemp("corr"), "correlated"))


def _engine(ck, **kw) -> Engine:
    kw.setdefault("policy", FixedDepth(3))
    rcfg = RuntimeConfig(ops="kernels", device="cuda", ring_pad=8, max_positions=512, **kw)
    return Engine(from_checkpoint(ck, rcfg.device, 512), rcfg)


def cache_digest(eng: Engine) -> str:
    return caches_digest(eng.session.caches)


def _run(ck, req, on_round=None, **kw):
    eng = _engine(ck, **kw)
    res = eng.generate(req, on_round=on_round)
    return res.tokens, rounds_key(res), cache_digest(eng)


@pytest.mark.parametrize("sampling", [SAMPLING, GREEDY], ids=["sampling", "greedy"])
def test_graph_equals_eager(ckpt, sampling):
    req = GenerationRequest(PROMPT, 80, sampling, 3)
    eager = _run(ckpt, req)
    graph = _run(ckpt, req, graphs=True)
    assert graph[0] == eager[0]
    assert graph[1] == eager[1]
    assert graph[2] == eager[2]
    assert len(eager[1]) >= 10


def test_log_read_interval_changes_nothing(ckpt):
    """sync_rounds 8 launches up to 7 rounds after the last one that counts: they must be
    no-ops (0 live rows, nothing committed). A stop token ends the request mid-batch."""
    req = GenerationRequest(PROMPT, 60, SAMPLING, 4)
    every = _run(ckpt, req, on_round=lambda rec: None, graphs=True)
    stop = every[0][len(every[0]) // 2]
    req_stop = GenerationRequest(PROMPT, 60, SAMPLING, 4, stop_ids=(stop,))
    for r in (req, req_stop):
        a = _run(ckpt, r, on_round=lambda rec: None, graphs=True)
        b = _run(ckpt, r, graphs=True, sync_rounds=8)
        assert a == b
    assert _run(ckpt, req_stop, graphs=True, sync_rounds=8)[0][-1] == stop


def test_padded_width_equals_exact_width(ckpt):
    req = GenerationRequest(PROMPT, 48, SAMPLING, 5)
    assert _run(ckpt, req, max_width=8, graphs=True) == _run(ckpt, req, max_width=4, graphs=True)


def test_digest_is_sensitive(ckpt):
    """A changed seed changes tokens and caches; a cache with one K element flipped changes the
    digest — the equalities above can fail."""
    req = GenerationRequest(PROMPT, 24, SAMPLING, 6)
    eng = _engine(ckpt)
    eng.generate(req)
    d0 = cache_digest(eng)
    c = eng.session.caches.target[2]
    slot = int((c.slot_pos.cpu() >= 0).nonzero()[0, 0])
    c.k[slot].view(-1)[0] += 1  # a held slot
    assert cache_digest(eng) != d0
    assert _run(ckpt, GenerationRequest(PROMPT, 24, SAMPLING, 7))[2] != d0


def test_adaptive_graph_equals_eager_on_the_mini_model():
    """One captured graph at depth 7 whose later depths are gated by the device control step:
    replays equal eager launches, depths vary within 3 … 7."""
    from reference.depth import AdaptiveDepth

    mini = load_checkpoint(Path(__file__).resolve().parents[2] / "models" / "mini")
    policy = AdaptiveDepth(weights=((0.0, 0.0, 1.0, 0.0, 0.0, 0.0),) * 4, threshold=0.5)
    req = GenerationRequest((490, 290, 263, 434, 1085, 337), 64, SAMPLING, 21)
    eager = _run(mini, req, policy=policy)
    graph = _run(mini, req, policy=policy, graphs=True)
    assert graph == eager
    depths = {len(r[1]) for r in eager[1]}
    assert min(depths) >= 3 and max(depths) <= 7 and len(depths) > 1, depths


def test_expert_prefetch_changes_no_bit():
    """The mini model ships a predictor (models/mini/prefetch.*): with prefetch on, the sliding
    layers' prefetch kernels run at 4 live rows (depth 3) and warm predicted experts; tokens,
    round records and caches equal a run with prefetch off, graphs and eager alike."""
    mini = Path(__file__).resolve().parents[2] / "models" / "mini"
    req = GenerationRequest((490, 290, 263, 434, 1085, 337), 48, SAMPLING, 8)
    runs = {}
    for pre in (True, False):
        for graphs in (True, False):
            rc = RuntimeConfig(ops="kernels", device="cuda", ring_pad=8, max_positions=512,
                               policy=FixedDepth(3), graphs=graphs, prefetch=pre)
            eng = Engine.from_checkpoint(mini, rc)
            assert (eng.target.prefetcher is not None) == pre
            res = eng.generate(req)
            runs[pre, graphs] = (res.tokens, rounds_key(res), cache_digest(eng))
            if pre:
                sink = next(iter(eng.target.prefetcher.buffers.values())).sink.cpu()
                assert sink.abs().sum() > 0, "the prefetch kernels never ran (sink still 0)"
    first = runs[True, True]
    assert all(v == first for v in runs.values()), [k for k, v in runs.items() if v != first]
