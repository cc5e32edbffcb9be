"""qualification.routing_flips: the first routing flip per position, its near-tie test against the
matched reference's own router variation, and the judgement of out-of-band positions."""

from __future__ import annotations

import pytest
import torch

from qualification import routing_flips as rf
from qualification.mini_engine import engine, load_mini, prompts
from reference.model import ReferenceModel


def routes(scores: torch.Tensor, k: int):
    """Router inputs equal to the scores (router weight = identity) and their top-k ids."""
    return scores.float(), scores.topk(k, dim=-1).indices


def test_find_measures_the_gap_and_counts_consequences():
    eye = {1: torch.eye(4), 2: torch.eye(4)}
    m = torch.tensor([[4.0, 3.0, 2.9, 0.0], [4.0, 3.0, 1.0, 0.0]])  # [T=2, E=4]
    f = m + torch.tensor([[0.0, 0.05, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # fp32: δ = 0.05 at p0
    matched = {1: routes(m, 2), 2: routes(m, 2)}
    fp32 = {1: routes(f, 2), 2: routes(f, 2)}
    cand = {1: torch.tensor([[0, 2], [0, 1]]), 2: torch.tensor([[0, 2], [0, 2]])}
    flips = rf.find(cand, matched, fp32, eye, multiple=3.0, floor=0.0)
    assert [(x.position, x.layer, x.later) for x in flips] == [(0, 1, 1), (1, 2, 0)]
    assert flips[0].gap == pytest.approx(0.1) and flips[0].allowed == pytest.approx(0.15)
    assert flips[0].legal  # 3.0 vs 2.9 is a near-tie for a router that moved by 0.05
    assert flips[1].gap == pytest.approx(2.0) and not flips[1].legal  # δ = 0 at p1
    ok, lines = rf.judge(torch.tensor([0.5, 0.1]), torch.tensor([0.2, 0.2]), flips)
    assert not ok and "1 not near-ties" in lines[0] and "1 excused" in lines[0]
    ok, _ = rf.judge(torch.tensor([0.5, 0.1]), torch.tensor([0.2, 0.2]), flips[:1])
    assert ok
    ok, lines = rf.judge(torch.tensor([0.5, 0.3]), torch.tensor([0.2, 0.2]), flips[:1])
    assert not ok and "without a flip: positions [1]" in lines[-1]
    with pytest.raises(ValueError, match="traced layers differ"):
        rf.find({1: cand[1]}, matched, fp32, eye, 3.0, 0.0)


@pytest.fixture(scope="module")
def mini():
    ckpt = load_mini()
    params = ckpt.dequantized()
    toks = torch.tensor(prompts(48)[0].ids[:48])
    refs = {p: ReferenceModel(ckpt.cfg, params, p) for p in ("matched", "fp32")}
    traces = {p: rf.reference_routes(m, toks) for p, m in refs.items()}
    router = {i: params[f"model.layers.{i}.mlp.router.weight"] for i in traces["matched"]}
    return ckpt, toks, traces, router


def perturbed_flips(mini, scale: float, bias: float) -> list[rf.Flip]:
    """The twins engine (bit-exact with matched) with layer 3's router changed: every weight
    times (1 + scale·noise), and expert 5's score shifted by bias · its rms."""
    ckpt, toks, traces, router = mini
    eng = engine(ckpt, 3)
    w = eng.w.layers[3].moe.router  # [E, H] FP32
    g = torch.Generator().manual_seed(0)
    w.mul_(1 + scale * torch.randn(w.shape, generator=g))
    w[5] += bias * w.pow(2).mean().sqrt()
    cand, _, _ = rf.runtime_routes(eng, toks.tolist())
    return rf.find(cand, traces["matched"], traces["fp32"], router, 3.0, 0.0)


@pytest.mark.slow
def test_unchanged_runtime_has_no_flip(mini):
    assert perturbed_flips(mini, 0.0, 0.0) == []


def test_rounding_sized_change_flips_only_near_ties(mini):
    flips = perturbed_flips(mini, 1e-3, 0.0)  # (its mixing weights move later layers too)
    assert flips and min(f.layer for f in flips) >= 3, flips
    assert all(f.legal for f in flips), [f.line() for f in flips]


@pytest.mark.slow
def test_biased_expert_gives_illegal_flips(mini):
    flips = perturbed_flips(mini, 0.0, 8.0)
    assert sum(not f.legal for f in flips) >= 3, [f.line() for f in flips]


def test_stability_run_excuses_only_legal_flips():
    """stability.run with `flips`: a candidate (bf16 scaled logits) outside the band at every
    position passes only where a legal flip is given; an illegal flip fails the run."""
    from qualification import stability
    from reference.config import preset
    from reference.synthetic import synthetic_params

    cfg = preset("tiny")
    params = synthetic_params(cfg, 0)
    fp32, bf16 = (ReferenceModel(cfg, params, p) for p in ("fp32", "bf16"))
    sc = stability.StabilityConfig(prompts=1, length=20)

    def cand(t):
        return stability._logits(bf16, t) * 1.5

    ok, _, ev = stability.run(fp32, bf16, cand, sc)
    assert not ok
    every = [rf.Flip(p, 1, 0.0, 1.0, 0) for p in range(20)]
    ok, worst, ev = stability.run(fp32, bf16, cand, sc, flips=lambda t: every)
    assert ok and worst == 0.0 and "20 flipped positions excused" in ev[-1], ev
    some = every[:19] + [rf.Flip(19, 1, 2.0, 1.0, 0)]
    ok, _, ev = stability.run(fp32, bf16, cand, sc, flips=lambda t: some)
    assert not ok and "1 not near-ties" in ev[0], ev
