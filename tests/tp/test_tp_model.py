"""The target model split over 2 gloo ranks (iquestrt/tp/shard.py + iquestrt/tp/model.py, twins
ops): both ranks compute the same logits bit for bit, and the logits stay within gate 1's FP32
stability band (m × the matched reference's envelope under appends, positions outside excused
only by legal routing flips) on the tiny and the trained mini model. A rank that sums only its
own partials fails that comparison.

Dimension letters: T prompt tokens, V vocabulary."""

from __future__ import annotations

import pytest
import torch
import tp_workers
from tp_harness import free_port, spawn

from qualification import mini_engine, routing_flips, stability
from qualification.runtime_gate import APPENDS
from reference.checkpoint import load_checkpoint, make_synthetic_checkpoint
from reference.model import ReferenceModel

RANK_TIMEOUT_S = 120.0
SPAWN_TIMEOUT_S = 400.0
WORLD = 2


def prompt(model: str, ck) -> torch.Tensor:
    """Tokens [T + APPENDS]; T wraps the target ring (tiny 16 + 8 slots, mini 128 + 8)."""
    if model == "mini":
        return torch.tensor(mini_engine.prompts(160 + APPENDS)[0].ids[: 160 + APPENDS])
    gen = torch.Generator().manual_seed(13)
    return torch.randint(0, ck.cfg.target.vocab_size, (40 + APPENDS,), generator=gen)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "ck"
    make_synthetic_checkpoint(d, "tiny", 0, fmt="fp8")
    return d


def run(directory, toks: torch.Tensor, tmp, broken: str = "", ops: str = "twins",
        reduce: str = "gather") -> list[dict]:
    T = toks.shape[0] - APPENDS
    spawn(tp_workers.model_worker, WORLD, (WORLD, free_port(), str(tmp), RANK_TIMEOUT_S,
                                          str(directory), toks[:T].tolist(), broken, ops, reduce),
          SPAWN_TIMEOUT_S)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


def judge(ck, toks: torch.Tensor, res: dict) -> tuple[bool, list[str]]:
    """Gate 1's criterion (qualification/runtime_gate.py) for the TP logits."""
    T = toks.shape[0] - APPENDS
    params = ck.dequantized()
    fp32, matched = (ReferenceModel(ck.cfg, params, p) for p in ("fp32", "matched"))
    cfg = stability.StabilityConfig(prompts=1, length=T, appends=(1, APPENDS))
    cand, _, allowed = stability.per_position(fp32, matched, res["logits"], cfg, toks)
    routes: dict[int, list] = {}
    for layer, ids in res["routes"]:
        routes.setdefault(layer, []).append(ids)
    router = {i: params[f"model.layers.{i}.mlp.router.weight"] for i in routes}
    flips = routing_flips.find({i: torch.cat(v) for i, v in routes.items()},
                               routing_flips.reference_routes(matched, toks[:T]),
                               routing_flips.reference_routes(fp32, toks[:T]), router,
                               cfg.multiple, 0.0)
    ok, lines = routing_flips.judge(cand, allowed, flips)
    worst = float((cand / allowed).max())
    return ok, lines + [f"worst cand/allowed {worst:.0%} (flipped positions included)"]


@pytest.mark.parametrize("model", ["tiny", "mini"])
@pytest.mark.slow
def test_ranks_agree_and_stay_within_the_band(model, tiny_dir, tmp_path):
    directory = tiny_dir if model == "tiny" else mini_engine.MINI
    ck = load_checkpoint(directory)
    toks = prompt(model, ck)
    res = run(directory, toks, tmp_path)
    assert torch.equal(res[0]["logits"], res[1]["logits"]), "ranks computed other logits"
    assert [(i, x.tolist()) for i, x in res[0]["routes"]] == \
        [(i, x.tolist()) for i, x in res[1]["routes"]], "ranks routed differently"
    assert not res[0]["flags"].any(), "a readiness flag was raised"
    assert res[0]["logits"].shape == (toks.shape[0] - APPENDS, ck.cfg.target.vocab_size)
    ok, lines = judge(ck, toks, res[0])
    print(f"\n  {model} TP2: " + "; ".join(lines))
    assert ok, lines


@pytest.mark.slow
def test_a_missing_reduction_fails_the_band(tiny_dir, tmp_path):
    ck = load_checkpoint(tiny_dir)
    toks = prompt("tiny", ck)
    res = run(tiny_dir, toks, tmp_path, broken="local_o")
    ok, lines = judge(ck, toks, res[0])
    assert not ok, lines


@pytest.mark.slow
def test_kernels_under_the_interpreter_compose_with_tp(tiny_dir, tmp_path):
    """The production kernels (interpreted) on both ranks: the partial buffers, tails with the
    gathered partials and the sharded kernel sampler's inputs work as on a GPU. Then
    RuntimeConfig.tp_reduce "peer": every O and expert reduction through the rings instead
    (shared files between the two processes, the interpreted tails polling the peer's slots) —
    the same partials summed in the same order, so the same logits and routing, bit for bit,
    with no readiness flag."""
    ck = load_checkpoint(tiny_dir)
    toks = prompt("tiny", ck)[: 24 + APPENDS]
    (tmp_path / "gather").mkdir()
    (tmp_path / "peer").mkdir()
    res = run(tiny_dir, toks, tmp_path / "gather", ops="kernels")
    assert torch.equal(res[0]["logits"], res[1]["logits"])
    ok, lines = judge(ck, toks, res[0])
    assert ok, lines
    # the first two chunks (16 positions, causal: the same logits as in the longer prefill)
    peer = run(tiny_dir, toks[: 16 + APPENDS], tmp_path / "peer", ops="kernels", reduce="peer")
    for rank in range(WORLD):
        assert not peer[rank]["flags"].any(), f"rank {rank}: a readiness wait timed out"
        assert torch.equal(peer[rank]["logits"], res[rank]["logits"][:16]), f"rank {rank}"
        routes = peer[rank]["routes"]  # (layer, ids) per chunk and MoE layer, chunk-major
        assert [(i, x.tolist()) for i, x in routes] == \
            [(i, x.tolist()) for i, x in res[rank]["routes"][: len(routes)]]
