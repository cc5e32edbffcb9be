"""The device loop (iquestrt/cond_nodes.py, iquestrt/cond_graph.py) on the GPU: the WHILE node's
mechanics on a toy body (a PyTorch op and a Triton kernel), its bounds, the bounded host wait, and
bit-exactness of the engine's device loop against the host loop and eager launches (tokens, round
records, caches). GPU only: PyTorch has no conditional nodes on the CPU and the CPU suite never
pretends to test them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iquestrt.config import RuntimeConfig
from iquestrt.engine import Engine, EngineError
from iquestrt.snapshot import caches_digest
from iquestrt.weights import from_checkpoint
from reference.checkpoint import load_checkpoint
from reference.depth import AdaptiveDepth, FixedDepth
from reference.speculative import GenerationRequest
from tests.helpers.engine_setup import GREEDY, SAMPLING, make_ckpt, rounds_key

pytestmark = pytest.mark.gpu
PROMPT = (5, 17, 300, 22, 9, 411, 78, 150, 3, 64, 200)
MINI = Path(__file__).resolve().parents[2] / "models" / "mini"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return load_checkpoint(make_ckpt(tmp_path_factory.mktemp("corr"), "correlated"))


def _run(ck, req, on_round=None, on_tokens=None, **kw):
    kw.setdefault("policy", FixedDepth(3))
    rcfg = RuntimeConfig(ops="kernels", device="cuda", ring_pad=8, max_positions=512, **kw)
    eng = Engine(from_checkpoint(ck, rcfg.device, 512), rcfg)
    res = eng.generate(req, on_round=on_round, on_tokens=on_tokens)
    return res.tokens, rounds_key(res), caches_digest(eng.session.caches), res.stop_reason


# --- the WHILE node on a toy body ---------------------------------------------------------------


def _mark_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _mark(round_ptr, seen_ptr):
        r = tl.load(round_ptr)
        tl.store(seen_ptr + r, r)

    return _mark


def _toy(limit: int, max_iters: int, done_at: int | None = None):
    """Body: round += 1 (torch), a Triton kernel copies round into seen[round]; done is set by
    the body when round reaches done_at."""
    from iquestrt.cond_graph import CondGraph
    from iquestrt.cond_nodes import ConditionKernel

    mark = _mark_kernel()
    dev = torch.device("cuda")
    done = torch.zeros(1, dtype=torch.int32, device=dev)
    rnd = torch.zeros(1, dtype=torch.int32, device=dev)
    seen = torch.full((64,), -1, dtype=torch.int32, device=dev)

    def body():
        rnd.add_(1)
        mark[(1,)](rnd, seen)
        if done_at is not None:
            done.copy_((rnd >= done_at).to(torch.int32))

    body()  # compile outside the capture
    loop = CondGraph(body, [], lambda: None, ConditionKernel.compile(dev), (done, rnd))
    rnd.zero_()
    seen.fill_(-1)
    done.zero_()
    loop.launch(limit, max_iters)
    torch.cuda.synchronize()
    out = int(rnd[0]), seen.cpu().tolist(), int(loop.ctrl[1])
    loop.close()
    return out


def test_while_node_runs_until_the_limit():
    rnd, seen, iters = _toy(limit=17, max_iters=40)
    assert rnd == 17 and iters == 17
    assert seen[1:18] == list(range(1, 18)) and seen[18] == -1


def test_while_node_stops_when_done():
    rnd, _, iters = _toy(limit=40, max_iters=40, done_at=5)
    assert rnd == 5 and iters == 5


def test_while_node_is_bounded_by_max_iters():
    """A body that would never reach the limit (a bug) still ends after max_iters."""
    rnd, _, iters = _toy(limit=10**6, max_iters=9)
    assert rnd == 9 and iters == 9


@pytest.mark.parametrize("looping", [False, True], ids=["round", "while"])
def test_if_nodes_run_exactly_the_parts_asked_for(looping):
    """pre → IF part 0 → IF part 1 → IF part 2 (nested), then post. `want` says how many parts
    run; a skipped part's kernels must not execute (its hit counter stays), and nor may any
    later part's even if its own flag would say run."""
    from iquestrt.cond_graph import CondGraph
    from iquestrt.cond_nodes import ConditionKernel

    mark = _mark_kernel()
    dev = torch.device("cuda")
    want = torch.zeros(1, dtype=torch.int32, device=dev)
    hits = torch.zeros(3, dtype=torch.int32, device=dev)
    posts = torch.zeros(1, dtype=torch.int32, device=dev)
    seen = torch.full((12,), -1, dtype=torch.int32, device=dev)  # part i marks 4i + hits[i]
    skip_one = torch.zeros(1, dtype=torch.int32, device=dev)  # part 1's flag only
    done = torch.zeros(1, dtype=torch.int32, device=dev)

    def pre():
        return (want >= 1).to(torch.int32)

    def part(i):
        hits[i : i + 1].add_(1)
        mark[(1,)](hits[i : i + 1], seen[4 * i : 4 * i + 4])
        flag = (want >= i + 2).to(torch.int32)
        return flag if i != 1 else flag * (1 - skip_one)

    def post():
        posts.add_(1)

    parts = [(i, lambda i=i: part(i)) for i in range(3)]
    pre(), [p() for _, p in parts], post()  # compile outside the capture
    g = CondGraph(pre, parts, post, ConditionKernel.compile(dev),
                  (done, posts) if looping else None)
    assert g.if_nodes == 3
    for w, skip, expect in ((0, 0, [0, 0, 0]), (2, 0, [1, 1, 0]), (3, 0, [1, 1, 1]),
                            (1, 0, [1, 0, 0]), (3, 1, [1, 1, 0])):
        want.fill_(w)
        skip_one.fill_(skip)
        hits.zero_()
        posts.zero_()
        if looping:
            g.launch(3, 3)  # posts counts rounds: three iterations
        else:
            g.launch_round()
        torch.cuda.synchronize()
        rounds = 3 if looping else 1
        assert hits.cpu().tolist() == [e * rounds for e in expect], (w, skip)
        assert int(posts[0]) == rounds
    g.close()


def test_bounded_wait_fails_instead_of_hanging():
    from iquestrt.cond_nodes import DeviceTimeout, wait_bounded

    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ≈1 s of spinning on the current stream
    with pytest.raises(DeviceTimeout, match=r"did not finish within 0.05 s"):
        wait_bounded(torch.cuda.current_stream(), 0.05, "a long kernel")
    torch.cuda.synchronize()


# --- the engine: device loop = host loop = eager --------------------------------------------------


@pytest.mark.parametrize("sampling", [SAMPLING, GREEDY], ids=["sampling", "greedy"])
def test_device_loop_equals_host_loop_and_eager(ckpt, sampling):
    req = GenerationRequest(PROMPT, 80, sampling, 3)
    eager = _run(ckpt, req)
    host = _run(ckpt, req, graphs=True, sync_rounds=8)
    device = _run(ckpt, req, graphs=True, loop="device")
    assert device == host == eager
    assert len(eager[1]) >= 10


def test_device_loop_stop_token_watching_and_streaming(ckpt):
    """A stop token mid-request; a watched request (one launch per round); a streamed one (a
    launch per ≈32 tokens) with cancellation after the first chunk."""
    base = _run(ckpt, GenerationRequest(PROMPT, 60, SAMPLING, 4))
    stop = base[0][len(base[0]) // 2]
    req = GenerationRequest(PROMPT, 60, SAMPLING, 4, stop_ids=(stop,))
    host = _run(ckpt, req, graphs=True)
    assert host[0][-1] == stop
    assert _run(ckpt, req, graphs=True, loop="device") == host
    watched = []
    assert _run(ckpt, req, on_round=watched.append, graphs=True, loop="device") == host
    assert len(watched) == len(host[1])
    chunks = []
    streamed = _run(ckpt, GenerationRequest(PROMPT, 60, SAMPLING, 4),
                    on_tokens=chunks.append, graphs=True, loop="device")
    assert streamed[:3] == base[:3] and sum(map(len, chunks)) == len(base[0])
    assert len(chunks) >= 2
    cancelled = _run(ckpt, GenerationRequest(PROMPT, 60, SAMPLING, 4),
                     on_tokens=lambda new: False, graphs=True, loop="device")
    assert cancelled[3] == "cancelled" and cancelled[0] == base[0][: len(cancelled[0])]


def test_device_loop_adaptive_depth_on_the_mini_model():
    mini = load_checkpoint(MINI)
    policy = AdaptiveDepth(weights=((0.0, 0.0, 1.0, 0.0, 0.0, 0.0),) * 4, threshold=0.5)
    req = GenerationRequest((490, 290, 263, 434, 1085, 337), 64, SAMPLING, 21)
    host = _run(mini, req, policy=policy, graphs=True)
    device = _run(mini, req, policy=policy, graphs=True, loop="device")
    assert device == host
    depths = {len(r[1]) for r in host[1]}
    assert min(depths) >= 3 and max(depths) <= 7 and len(depths) > 1, depths


def test_device_loop_timeout_is_an_engine_error(ckpt):
    """wait_s smaller than one launch's work: the request fails with a named error."""
    req = GenerationRequest(PROMPT, 200, SAMPLING, 5)
    with pytest.raises(EngineError, match="did not finish within 1e-06 s"):
        _run(ckpt, req, graphs=True, loop="device", wait_s=1e-6)
    torch.cuda.synchronize()
