"""Whole requests on 2 gloo ranks (iquestrt/tp/engine.py, twins, the trained mini model): every
rank emits the same tokens and round records (sharded sampling gives each rank the same token, no
broadcast); greedy decoding equals the single-rank engine token for token, or parts only at a
near-tie (tests/tp/flip_check.py); with sampling the tokens may part where the target's slightly
different logits reorder two near-equal served probabilities (the draw order is by probability),
so only the ranks' agreement is exact there."""

from __future__ import annotations

import pytest
import torch
import tp_workers
from flip_check import check_greedy
from tp_harness import free_port, spawn

from iquestrt.config import RuntimeConfig, RuntimeConfigError
from iquestrt.engine import Engine
from iquestrt.tp.engine import TPEngine
from iquestrt.tp.group import TPGroup
from iquestrt.tp.peer_ring import ring_buffers
from iquestrt.weights import from_checkpoint
from kernels.readiness import RingPolicy
from qualification import mini_engine
from reference.checkpoint import load_checkpoint, make_synthetic_checkpoint
from reference.config import SamplingDefaults
from reference.depth import FixedDepth
from reference.speculative import GenerationRequest

PROMPT_TOKENS, NEW = 64, 48
GREEDY, SAMPLED = (0.0, 20, 1.0), (1.0, 20, 0.95)


def rcfg(cap: int, **kw) -> RuntimeConfig:
    return RuntimeConfig(ops="twins", ring_pad=8, max_positions=cap, policy=FixedDepth(3),
                         prefetch=False, **kw)


@pytest.fixture(scope="module")
def prompt():
    return list(mini_engine.prompts(PROMPT_TOKENS)[0].ids[:PROMPT_TOKENS])


def run_tp(prompt, sampling, tmp) -> list[dict]:
    spawn(tp_workers.generate_worker, 2, (2, free_port(), str(tmp), 120.0, str(mini_engine.MINI),
                                          prompt, NEW, sampling, 7), 400.0)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


def single(prompt, sampling):
    ck = load_checkpoint(mini_engine.MINI)
    cap = PROMPT_TOKENS + NEW + 16
    eng = Engine(from_checkpoint(ck, "cpu", cap), rcfg(cap))
    return eng.generate(GenerationRequest(tuple(prompt), NEW, SamplingDefaults(*sampling), 7))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.slow
def test_ranks_agree_and_greedy_equals_one_rank(prompt, sampling, tmp_path):
    r = run_tp(prompt, sampling, tmp_path)
    assert r[0]["tokens"] == r[1]["tokens"] and r[0]["rounds"] == r[1]["rounds"]
    assert len(r[0]["tokens"]) == NEW and len(r[0]["rounds"]) >= 10
    if sampling == GREEDY:
        line = check_greedy(load_checkpoint(mini_engine.MINI), prompt, r[0]["tokens"],
                            single(prompt, sampling).tokens)
        print(f"\n  {line or 'greedy TP2 == TP1 for every token'}")


def test_tp_engine_refuses_what_it_cannot_do():
    ck = load_checkpoint(mini_engine.MINI)
    w = from_checkpoint(ck, "cpu", 256)
    with pytest.raises(ValueError, match="use Engine"):
        TPEngine(w, rcfg(256), TPGroup(0, 1, "gloo", torch.device("cpu"), 10.0))


def test_the_peer_reduction_is_refused_where_it_cannot_apply():
    with pytest.raises(RuntimeConfigError, match="tp_reduce: choose one of"):
        rcfg(256, tp_reduce="sum")
    with pytest.raises(RuntimeConfigError, match="'peer' needs ops='kernels'"):
        rcfg(256, tp_reduce="peer")
    w = from_checkpoint(load_checkpoint(mini_engine.MINI), "cpu", 256)
    peer = RuntimeConfig(ops="kernels", ring_pad=8, max_positions=256, tp_reduce="peer")
    with pytest.raises(ValueError, match="tp_reduce 'peer' applies to tensor parallelism"):
        Engine(w, peer)


@pytest.mark.slow
def test_a_tp_engine_builds_its_rings(tmp_path):
    """TPEngine with tp_reduce "peer" on 2 gloo ranks (interpreted kernels, tiny): both ranks use
    the ring files of one directory rank 0 made (O ring with the O projection's split-K count,
    MoE ring), one target forward runs through them with no readiness flag, and both ranks get
    the same logits."""
    d = tmp_path / "ck"
    make_synthetic_checkpoint(d, "tiny", 0, fmt="fp8")
    spawn(tp_workers.engine_rings_worker, 2, (2, free_port(), str(tmp_path), 60.0, str(d)),
          240.0)
    r = [torch.load(tmp_path / f"rank{q}.pt") for q in range(2)]
    assert r[0]["directory"] == r[1]["directory"]
    assert r[0]["files"] == ["moe-rank0.bin", "moe-rank1.bin", "o-rank0.bin", "o-rank1.bin"]
    layers = load_checkpoint(d).cfg.target.num_hidden_layers
    for q in range(2):
        assert r[q]["o_parts"] == r[q]["made"], "O ring slots != the partials the GEMM makes"
        assert not r[q]["flags"].any() and torch.isfinite(r[q]["logits"]).all()
        assert r[q]["steps"] == (layers, layers - 1)  # every attention tail; MoE layers ≥ 1
        assert r[q]["buffers"] == tuple(ring_buffers(n) or 3 for n in (layers, layers - 1))
        assert r[q]["written"] and r[q]["armed"] and r[q]["after_reset"] == (0, 0)


def test_ring_slots_divide_the_reductions_of_a_forward():
    """A captured round replays fixed slots: a ring's slot count must divide the reductions it
    takes per forward (and be >= 3, the least safe ring) so every forward starts at slot 0."""
    assert [ring_buffers(n) for n in (1, 2, 3, 4, 7, 8, 9, 87, 88)] == \
        [None, None, 3, 4, 7, 4, 3, 3, 4]
    for n in range(3, 200):
        b = ring_buffers(n)
        assert n % b == 0 and b >= 3 and RingPolicy(buffers=b).safe


def test_tp_graphs_on_the_device_loop_are_refused():
    """Checked before anything is sharded or allocated (a CUDA device string needs no GPU)."""
    w = from_checkpoint(load_checkpoint(mini_engine.MINI), "cpu", 256)
    g = TPGroup(0, 2, "gloo", torch.device("cpu"), 10.0)
    loop = RuntimeConfig(ops="kernels", device="cuda", max_positions=256, ring_pad=8,
                         prefetch=False, graphs=True, loop="device")
    with pytest.raises(ValueError, match="loop 'device' is not supported with tensor"):
        TPEngine(w, loop, g)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one per NCCL rank)")
@pytest.mark.parametrize("reduce", ["gather", "peer"])
def test_tp2_graphs_equal_eager_over_two_requests(reduce, tmp_path):
    """TP2 over NCCL with one captured graph per round (its collectives and, with "peer", its
    ring slots inside): sampled decodes of two consecutive requests equal eager launches', with
    finished-request rounds (0 live rows) run between them; both ranks agree."""
    spawn(tp_workers.graphs_worker, 2, (2, free_port(), str(tmp_path), 120.0, reduce), 600.0)
    r = [torch.load(tmp_path / f"rank{q}.pt") for q in range(2)]
    assert r[0] == r[1]
    for i in range(2):
        assert r[0][True, i] == r[0][False, i], f"request {i}: graphs != eager"
        assert len(r[0][True, i][0]) == 40
