"""The BF16 torch baseline computes the model it is compared against: its target forward matches
reference/model.py (bf16 mode, same weights) under the table's row, broken variants do not, and
its speculative round runs on the CPU in both expert modes."""

import dataclasses

import pytest
import torch

from benchmarks.rank import baseline as bl
from benchmarks.rank.baseline_run import BaselineRound, BaselineTimes
from benchmarks.rank.shapes import small_rank_config
from qualification.tolerances import check, measure, tolerance
from reference.model import ReferenceModel

CFG = small_rank_config()
ROW = ("bench_rank.baseline_vs_reference", "bf16")


def _pair(seed: int, experts: str, rows: int = 24):
    b = BaselineRound(CFG, CFG.target.layer_types, "cpu", seed, 0, 3, None, experts, False)
    toks = torch.randint(0, CFG.target.vocab_size, (rows,),
                         generator=torch.Generator().manual_seed(seed))
    ref = ReferenceModel(CFG, b.p, "bf16").target(toks, torch.arange(rows)).logits
    return b, toks, ref


@pytest.mark.parametrize("experts", bl.EXPERT_MODES)
@pytest.mark.parametrize("seed", [0, 5])
@pytest.mark.slow
def test_target_matches_the_reference(experts, seed):
    b, toks, ref = _pair(seed, experts)
    logits, _ = b.target(toks, torch.arange(toks.shape[0]), None)
    check(logits, ref, *ROW)


@pytest.mark.slow
def test_broken_variants_exceed_the_row(monkeypatch):
    b, toks, ref = _pair(0, "gather")
    pos = torch.arange(toks.shape[0])
    b.t = dataclasses.replace(CFG.target, ffn_out_scale=1.0)
    assert not measure(b.target(toks, pos, None)[0], ref, tolerance(*ROW)).ok
    b, toks, ref = _pair(0, "gather")
    real = bl.ops.attention
    monkeypatch.setattr(bl.ops, "attention",
                        lambda q, k, v, qp, kp, w, sink, scale, out_dtype=None:
                        real(q, k, v, qp, kp, w, None, scale, out_dtype))
    assert not measure(b.target(toks, pos, None)[0], ref, tolerance(*ROW)).ok


@pytest.mark.parametrize("experts", bl.EXPERT_MODES)
def test_rounds_advance_the_request(experts):
    ids = torch.randint(0, CFG.target.num_experts, (3, 7, 8, 8))
    b = BaselineRound(CFG, CFG.target.layer_types, "cpu", 1, 40, 3, ids, experts, False)
    for _ in range(3):
        m = b.m
        a = b.round()
        assert 0 <= a <= 3 and b.m == m + a + 1
        assert 0 <= int(b.x_m) < CFG.target.vocab_size and torch.isfinite(b.hprev.float()).all()
    assert b.step == 3


def test_layer_scaling_by_kind():
    # a subset of dense + 2 full + 1 sliding layers, each full layer 2 ms, sliding 1 ms, dense 3
    t = BaselineTimes(round_s=[0.020, 0.030, 0.025], layer_s=[[0.003, 0.002, 0.001, 0.002]] * 3,
                      kinds=["dense", "full", "sliding", "full"],
                      scale_to={"dense": 1, "full": 24, "sliding": 63})
    rest = 0.025 - 0.008  # the median round without its layers
    assert t.scaled_round_s() == pytest.approx(rest + 0.003 + 24 * 0.002 + 63 * 0.001)
