"""One engine serving several requests: caches, readiness flags, device state and the round
program (with its captured graphs on a GPU) are reused for every request of one shape (top_k /
greedy, stop-id room, positions and rounds within the state's capacity). A request on reused
buffers must give exactly what a fresh engine gives: tokens, every round record, cache contents.

Dimension letters: none (token lists and digests)."""

from __future__ import annotations

import gc

import pytest
import torch

from iquestrt.config import RuntimeConfig
from iquestrt.engine import Engine
from iquestrt.snapshot import caches_digest
from iquestrt.weights import from_checkpoint
from reference.checkpoint import load_checkpoint
from reference.config import SamplingDefaults
from reference.depth import FixedDepth
from reference.speculative import GenerationRequest
from tests.helpers.engine_setup import SAMPLING, make_ckpt, rounds_key

PROMPT = (5, 17, 300, 22, 9, 411, 78, 150, 3, 64, 200)
A = GenerationRequest(PROMPT * 3, 40, SAMPLING, 3)
# B's stop id is a token E emits in a round: a stop list left over from B would end E early
B = GenerationRequest(PROMPT[:7], 24, SamplingDefaults(0.7, 20, 0.8), 2**63 + 5, stop_ids=(286,))
E = GenerationRequest(PROMPT[2:], 30, SAMPLING, 11)
C = GenerationRequest(PROMPT, 12, SamplingDefaults(1.0, 8, 0.95), 9)  # top_k 8: another shape
D = GenerationRequest(PROMPT, 100, SAMPLING, 4)  # more rounds than A's state holds


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return load_checkpoint(make_ckpt(tmp_path_factory.mktemp("corr"), "correlated"))


def engine(ck, device="cpu", **kw) -> Engine:
    rcfg = RuntimeConfig(ops="twins" if device == "cpu" else "kernels", device=device,
                         ring_pad=8, max_positions=256, policy=FixedDepth(3), **kw)
    return Engine(from_checkpoint(ck, device, 256), rcfg)


def outcome(eng: Engine, req: GenerationRequest):
    res = eng.generate(req)
    return res.tokens, rounds_key(res), caches_digest(eng.session.caches)


def check_sequence(ck, device="cpu", **kw) -> Engine:
    eng = engine(ck, device, **kw)
    for i, req in enumerate((A, B, E, C, B, D)):
        got, want = outcome(eng, req), outcome(engine(ck, device, **kw), req)
        assert got[0] == want[0], f"request {i}: tokens differ from a fresh engine's"
        assert got[1] == want[1], f"request {i}: round records differ"
        assert got[2] == want[2], f"request {i}: caches differ"
    return eng


@pytest.mark.slow
def test_reused_buffers_equal_a_fresh_engine(ckpt):
    eng = check_sequence(ckpt)
    # A builds; B, E reuse; C (top_k 8) builds; B (top_k 20 again) builds; D (more rounds) builds
    assert (eng.programs.built, eng.programs.reused) == (4, 2)


@pytest.mark.slow
def test_reuse_needs_the_state_reset(ckpt, monkeypatch):
    """Without DeviceState.begin's reset the second request reads the first one's counters:
    the comparison above must see it."""
    from iquestrt.state import DeviceState

    real = DeviceState.begin

    def no_reset(self, req, vocab):
        done = self.round.clone()
        real(self, req, vocab)
        self.round.copy_(done)  # the round counter of the previous request survives

    monkeypatch.setattr(DeviceState, "begin", no_reset)
    eng = engine(ckpt)
    outcome(eng, A)
    with pytest.raises(AssertionError):
        assert outcome(eng, B) == outcome(engine(ckpt), B)


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["host", "device"])
def test_graphs_are_captured_once_per_shape(ckpt, loop):
    eng = check_sequence(ckpt, "cuda", graphs=True, loop=loop)
    assert (eng.programs.built, eng.programs.reused) == (4, 2)


def fill_free_blocks(device: str) -> list[torch.Tensor]:
    """Tensors of 0xff covering the allocator's free cached blocks (large to small, each size
    until the pool would grow): whatever a stale pointer still names now belongs to them."""
    filler = []
    for size in (2**k for k in range(26, 8, -1)):
        while True:
            before = torch.cuda.memory_reserved(device)
            t = torch.full((size,), 255, dtype=torch.uint8, device=device)
            if torch.cuda.memory_reserved(device) > before:
                break
            filler.append(t)
    return filler


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["host", "device"])
def test_a_captured_round_writes_only_memory_its_engine_holds(ckpt, loop):
    """A graph binds the round program's buffers (drafts, q rows, carries): when the launcher
    did not keep the program, those blocks were freed after capture and every replay wrote into
    whatever the allocator put there next (on the H200: four alternating engines changed each
    other's tokens). Here the freed blocks are taken by 0xff filler that must stay intact."""
    eng = engine(ckpt, "cuda", graphs=True, loop=loop)
    want = outcome(eng, A)
    gc.collect()
    filler = fill_free_blocks("cuda")
    got = outcome(eng, A)
    torch.cuda.synchronize()
    hit = [i for i, t in enumerate(filler) if not bool((t == 255).all())]
    assert not hit, f"replays wrote into {len(hit)} of {len(filler)} blocks the engine had freed"
    assert got == want


@pytest.mark.gpu
def test_alternating_engines_keep_their_own_results(ckpt):
    """The bench's pattern: engines of depths 3 and 5 built, then alternated."""
    engines = [Engine(from_checkpoint(ckpt, "cuda", 256),
                      RuntimeConfig(ops="kernels", device="cuda", ring_pad=8, max_positions=256,
                                    policy=FixedDepth(d), graphs=True, loop=loop))
               for d in (3, 5) for loop in ("host", "device")]
    first = [outcome(e, A) for e in engines]
    for _ in range(2):
        assert [outcome(e, A) for e in engines] == first
