"""reference/sampling.py: the pinned served distribution and the inverse-CDF draw.

Three kinds of oracle: a scalar numpy-float32 replay of the pinned semantics (bit-exact; exp in
FP64 by math.exp, rounded to FP32: reference.ops.exp32's definition), a float64 oracle (values,
tolerance row reference.served_distribution) and hand-worked cases (supports, orders, ties).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np
import pytest
import torch

from qualification.tolerances import check, measure, tolerance
from reference.config import SamplingDefaults as SP
from reference.rng import Purpose, uniforms
from reference.sampling import (
    SamplingError,
    draw,
    sample,
    seq_cumsum,
    served_candidates,
    served_distribution,
)

F32 = np.float32
GRID = 2**24  # u = k / GRID, k in [0, GRID)


# --- helpers shared with test_rejection.py ------------------------------------------------
def draw_runs_fp32(row: Sequence[float]) -> list[list[int]]:
    """[start, end, token] grid runs of the pinned draw, replayed on numpy fp32 scalars."""
    vals = [F32(v) for v in row]
    order = sorted((i for i, v in enumerate(vals) if v > 0), key=lambda i: (-vals[i], i))
    c, cs = F32(0), []
    for i in order:
        c = F32(c + vals[i])
        cs.append(c)
    z = cs[-1]

    def n_below(ci: np.float32) -> int:  # #{k : fl(k/GRID * z) < ci}, a prefix since fl is monotone
        lo, hi = 0, GRID
        while lo < hi:
            mid = (lo + hi) // 2
            if F32(mid / GRID) * z < ci:
                lo = mid + 1
            else:
                hi = mid
        return lo

    ends = [n_below(ci) for ci in cs]
    ends[-1] = GRID  # "if none, the last support element"
    starts = [0] + ends[:-1]
    return [[a, b, t] for a, b, t in zip(starts, ends, order, strict=True) if b > a]


def grid_segments(f: Callable[[int], int], lo: int = 0, hi: int = GRID) -> list[list[int]]:
    """[start, end, token] runs of f over k in [lo, hi) by bisection; each token one run."""
    runs: list[list[int]] = []

    def rec(a: int, b: int, fa: int, fb: int) -> None:
        if fa == fb:
            runs.append([a, b, fa])
        elif b - a == 2:
            runs.extend([[a, a + 1, fa], [a + 1, b, fb]])
        else:
            m = (a + b) // 2
            rec(a, m, fa, f(m - 1))
            rec(m, b, f(m), fb)

    rec(lo, hi, f(lo), f(hi - 1))
    merged: list[list[int]] = []
    for r in runs:
        if merged and merged[-1][2] == r[2]:
            merged[-1][1] = r[1]
        else:
            merged.append(r)
    tokens = [r[2] for r in merged]
    assert len(tokens) == len(set(tokens)), f"a token's preimage is not one interval: {merged}"
    return merged


def check_runs(f_many: Callable[[torch.Tensor], torch.Tensor], runs, n: int, seed: int) -> None:
    """Spot-check the runs: both ends of every run plus n random grid points."""
    g = torch.Generator().manual_seed(seed)
    ks = [k for a, b, _ in runs for k in (a, b - 1)]
    ks += torch.randint(0, GRID, (n,), generator=g).tolist()
    expect = [next(t for a, b, t in runs if a <= k < b) for k in ks]
    got = f_many(torch.tensor(ks, dtype=torch.float64).div(GRID).to(torch.float32))
    assert got.tolist() == expect


def runs_to_counts(runs) -> dict[int, int]:
    return {t: b - a for a, b, t in runs}


def exact_law_margin(counts: dict[int, int], ideal: dict[int, Fraction], op: str):
    """Tolerance-table check of a grid law (counts / 2^24) against an ideal rational law."""
    keys = sorted(set(counts) | set(ideal))
    got = torch.tensor([counts.get(t, 0) / GRID for t in keys], dtype=torch.float64)
    want = torch.tensor([float(ideal.get(t, 0)) for t in keys], dtype=torch.float64)
    return check(got, want, op, "fp32")


# --- oracles -------------------------------------------------------------------------------
def served_fp32_oracle(x: Sequence[float], p: SP) -> dict[int, np.float32]:
    """The module docstring's semantics replayed on numpy float32 scalars."""
    V = len(x)
    if p.temperature == 0:
        return {min(range(V), key=lambda i: (-x[i], i)): F32(1)}
    z = [F32(xi) / F32(p.temperature) for xi in x]
    order = sorted(range(V), key=lambda i: (-z[i], i))[: p.top_k or V]
    m = z[order[0]]
    e = {i: F32(math.exp(float(z[i] - m))) for i in order}  # FP64 exp rounded to FP32 (exp32)
    s = F32(0)
    for i in order:
        s = F32(s + e[i])
    pr = {i: F32(e[i] / s) for i in order}
    kept, c = [], F32(0)
    for i in sorted(order, key=lambda i: (-pr[i], i)):
        kept.append(i)
        c = F32(c + pr[i])
        if p.top_p < 1 and c >= F32(p.top_p):
            break
    s2 = F32(0)
    for i in kept:
        s2 = F32(s2 + pr[i])
    return {i: F32(pr[i] / s2) for i in kept}


def served_f64(x: Sequence[float], p: SP, swap: bool = False) -> tuple[dict[int, float], float]:
    """Float64 semantics and the smallest top-p decision margin. swap: top-p before top-k."""
    V = len(x)
    z = [xi / p.temperature for xi in x]
    order = sorted(range(V), key=lambda i: (-z[i], i))
    if not swap:
        order = order[: p.top_k or V]
    e = {i: math.exp(z[i] - z[order[0]]) for i in order}
    s = sum(e.values())
    pr = {i: e[i] / s for i in order}
    kept, c, margin = [], 0.0, math.inf
    for i in sorted(order, key=lambda i: (-pr[i], i)):
        kept.append(i)
        c += pr[i]
        if p.top_p < 1:
            margin = min(margin, abs(c - p.top_p))
            if c >= p.top_p:
                break
    if swap:
        kept = kept[: p.top_k or V]
    s2 = sum(pr[i] for i in kept)
    return {i: pr[i] / s2 for i in kept}, margin


def _row(d: dict, V: int) -> torch.Tensor:
    out = torch.zeros(V, dtype=torch.float64)
    for i, v in d.items():
        out[i] = float(v)
    return out


PARAMS = [SP(1.0, 0, 1.0), SP(0.7, 5, 0.9), SP(1.3, 3, 0.5), SP(2.0, 11, 0.95), SP(0.5, 0, 0.3)]


def _logits(seed: int, R: int = 24, V: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, V, generator=g) * 2).to(torch.float32)
    x[: R // 2] = (x[: R // 2] * 2).round() / 2  # ties in half the rows
    x[0, 3] = -float("inf")  # a masked token
    return x


# --- tests ---------------------------------------------------------------------------------
def test_seq_cumsum_is_a_left_to_right_fp32_loop():
    g = torch.Generator().manual_seed(3)
    x = torch.exp(torch.randn(6, 300, generator=g) * 6).to(torch.float32)  # wide dynamic range
    got = seq_cumsum(x)
    for r in range(6):
        c = F32(0)
        for i in range(300):
            c = F32(c + F32(x[r, i].item()))
            assert got[r, i].item() == float(c), (r, i)
    # torch.cumsum accumulates fp32 in double on CPU: a different (unpinned) result.
    assert not torch.equal(torch.cumsum(x, 1), got)


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_served_distribution_is_bit_exact_to_the_scalar_fp32_replay(params):
    x = _logits(1)
    probs = served_distribution(x, params)
    ids, cand = served_candidates(x, params)
    assert cand.shape == (24, params.top_k or 11)
    for r in range(x.shape[0]):
        want = served_fp32_oracle(x[r].tolist(), params)
        assert probs[r].tolist() == _row(want, 11).tolist(), f"row {r}"
        kept = sorted(want, key=lambda i: (-want[i], i))
        assert ids[r, : len(kept)].tolist() == kept  # draw order (served desc, index asc)
        assert cand[r, len(kept) :].eq(0).all()


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_served_distribution_matches_float64_semantics(params):
    x, tol = _logits(2, R=64), tolerance("reference.served_distribution", "fp32")
    probs = served_distribution(x, params).double()
    used = 0
    for r in range(x.shape[0]):
        want, margin = served_f64(x[r].double().tolist(), params)
        if margin < 1e-4:  # input selection: a near-tie at top_p may round either way
            continue
        used += 1
        assert set(torch.nonzero(probs[r]).flatten().tolist()) == {i for i in want if want[i]}
        assert measure(probs[r], _row(want, 11), tol).ok, measure(probs[r], _row(want, 11), tol)
    assert used >= 56


def test_top_k_boundary_ties_keep_the_lower_index():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0]])
    for k, support in [(1, {1}), (2, {1, 3}), (3, {1, 2, 3}), (4, {1, 2, 3, 4})]:
        probs = served_distribution(x, SP(1.0, k, 1.0))[0]
        assert set(torch.nonzero(probs).flatten().tolist()) == support, k
    ids, _ = served_candidates(x, SP(1.0, 0, 1.0))
    assert ids[0].tolist() == [1, 3, 2, 4, 5, 0]  # (prob desc, index asc)


def _drop_crossing_token(x: torch.Tensor, p: SP) -> torch.Tensor:
    """Mutant: top-p keeps only the prefix strictly below top_p (the crossing token dropped)."""
    ids, cand = served_candidates(x, SP(p.temperature, p.top_k, 1.0))
    keep = seq_cumsum(cand) < p.top_p
    keep[:, 0] = True
    cand = torch.where(keep, cand, torch.zeros_like(cand))
    return torch.zeros_like(x).scatter_(1, ids, cand / cand.sum(1, keepdim=True))


def test_top_p_keeps_the_token_that_crosses_p():
    x = torch.tensor([[math.log(3), math.log(5), math.log(2)]], dtype=torch.float32)  # .3 .5 .2
    cases = [(0.45, {1}), (0.6, {0, 1}), (0.79, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2})]
    for top_p, support in cases:
        probs = served_distribution(x, SP(1.0, 0, top_p))[0]
        assert set(torch.nonzero(probs).flatten().tolist()) == support, top_p
    probs = served_distribution(x, SP(1.0, 0, 0.6))[0].double()
    check(
        probs,
        torch.tensor([3 / 8, 5 / 8, 0.0], dtype=torch.float64),
        "reference.served_distribution",
        "fp32",
    )
    mutant = _drop_crossing_token(x, SP(1.0, 0, 0.6))[0]
    assert set(torch.nonzero(mutant).flatten().tolist()) != {0, 1}


def test_top_k_applies_before_top_p_on_the_renormalized_remainder():
    w = [4, 3, 2, 1, 1, 1, 1, 1]
    x = torch.tensor([[math.log(v) for v in w]], dtype=torch.float32)
    p = SP(1.0, 3, 0.6)
    # by hand: top-3 renormalized = 4/9, 3/9, 2/9; running 4/9 < .6 <= 7/9 -> keep {0, 1}
    probs = served_distribution(x, p)[0].double()
    check(probs, _row({0: 4 / 7, 1: 3 / 7}, 8), "reference.served_distribution", "fp32")
    # swapped: top-p on the full distribution (4/14, 7/14, 9/14 >= .6) then top-3 -> {0,1,2}
    swapped, _ = served_f64([math.log(v) for v in w], p, swap=True)
    assert set(swapped) == {0, 1, 2}
    with pytest.raises(AssertionError):
        check(
            _row(swapped, 8), _row({0: 4 / 7, 1: 3 / 7}, 8), "reference.served_distribution", "fp32"
        )


def test_temperature_scales_logits_before_everything():
    x = _logits(5)
    for k, tp in [(0, 1.0), (4, 0.8)]:
        assert torch.equal(
            served_distribution(x, SP(2.0, k, tp)), served_distribution(x / 2, SP(1.0, k, tp))
        )  # x / 2 is exact
    y = torch.tensor([[0.0, 1.0, 2.0]])
    for t in (0.25, 1.0, 4.0):
        want = [math.exp(v / t) for v in (0.0, 1.0, 2.0)]
        want = torch.tensor([v / sum(want) for v in want], dtype=torch.float64)
        check(
            served_distribution(y, SP(t, 0, 1.0))[0].double(),
            want,
            "reference.served_distribution",
            "fp32",
        )


def test_greedy_is_one_hot_at_the_lowest_argmax():
    x = torch.tensor([[0.0, 5.0, 5.0, -float("inf"), 1.0], [7.0, 7.0, 7.0, 7.0, 7.0]])
    probs = served_distribution(x, SP(0.0, 3, 0.5))
    assert probs.tolist() == [[0, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    ids, cand = served_candidates(x, SP(0.0, 0, 1.0))
    assert ids.tolist() == [[1], [0]] and cand.tolist() == [[1.0], [1.0]]


def _draw_rows() -> list[list[float]]:
    g = torch.Generator().manual_seed(9)
    served = served_distribution(torch.randn(3, 10, generator=g) * 2, SP(1.0, 6, 0.9))
    return served.tolist() + [
        [0.25, 0.125, 0.25, 0.375, 0.0],  # ties, a zero, dyadic (exact sums)
        [0.3, 0.2, 0.4],  # mass 0.9: draw normalizes by Z
        [1 - 2**-20, 2**-20, 0.0],  # a token of 16 grid points
        [0.5, 0.5, 1e-9],  # absorbed by rounding: c does not move, never drawn
    ]


@pytest.mark.parametrize("row", _draw_rows(), ids=lambda r: f"V{len(r)}")
def test_draw_hits_each_token_with_exactly_its_cdf_interval(row):
    probs = torch.tensor([row], dtype=torch.float32)

    def f(k: int) -> int:
        return int(draw(probs, torch.tensor([k / GRID], dtype=torch.float32))[0])

    runs = grid_segments(f)
    check_runs(lambda u: draw(probs.expand(len(u), -1), u), runs, n=2048, seed=len(row))
    assert runs == draw_runs_fp32(row)
    counts = runs_to_counts(runs)
    # and against the ideal law row / sum(row), in rationals
    total = sum(Fraction(float(F32(v))) for v in row)
    ideal = {i: Fraction(float(F32(v))) / total for i, v in enumerate(row) if v > 0}
    exact_law_margin(counts, ideal, "reference.emitted_token_law")


def test_draw_with_ties_broken_the_other_way_fails_the_interval_check():
    row = [0.25, 0.125, 0.25, 0.375, 0.0]
    flipped = torch.tensor([row[::-1]], dtype=torch.float32)

    def mutant(k: int) -> int:  # ties broken by the higher index
        return 4 - int(draw(flipped, torch.tensor([k / GRID], dtype=torch.float32))[0])

    assert grid_segments(mutant) != draw_runs_fp32(row)


def test_sample_is_draw_of_served_with_counter_uniforms():
    x = _logits(4, R=6)
    pos = torch.arange(100, 106, dtype=torch.int64)
    ids, probs = sample(x, SP(0.8, 4, 0.9), 77, pos, Purpose.DRAFT_SAMPLE)
    assert torch.equal(probs, served_distribution(x, SP(0.8, 4, 0.9)))
    assert torch.equal(ids, draw(probs, uniforms(77, pos, Purpose.DRAFT_SAMPLE)))
    assert (probs.gather(1, ids[:, None]) > 0).all()
    with pytest.raises(SamplingError, match="positions"):
        sample(x, SP(1.0, 4, 0.9), 1, pos[:3])


@pytest.mark.parametrize(
    "params,match",
    [
        (SP(-1.0, 0, 1.0), "temperature"),
        (SP(float("nan"), 0, 1.0), "temperature"),
        (SP(1.0, -1, 1.0), "top_k"),
        (SP(1.0, 12, 1.0), "top_k"),
        (SP(1.0, 2.0, 1.0), "top_k"),
        (SP(1.0, 0, 0.0), "top_p"),
        (SP(1.0, 0, 1.5), "top_p"),
        (SP(1e-40, 0, 1.0), "overflows"),
    ],
)
def test_bad_params_raise_named_errors(params, match):
    with pytest.raises(SamplingError, match=match):
        served_distribution(torch.full((1, 11), 1e3), params)


@pytest.mark.parametrize(
    "logits,match",
    [
        (torch.tensor([[0.0, float("nan")]]), "NaN"),
        (torch.tensor([[0.0, float("inf")]]), "inf"),
        (torch.full((1, 3), -float("inf")), "all -inf"),
        (torch.zeros(1, 3, dtype=torch.bfloat16), "float32"),
        (torch.zeros(3), r"\[R, V\]"),
    ],
)
def test_bad_logits_raise_named_errors(logits, match):
    with pytest.raises(SamplingError, match=match):
        served_distribution(logits, SP())


@pytest.mark.parametrize(
    "probs,u,match",
    [
        (torch.tensor([[0.5, 0.5]]), torch.tensor([1.0]), r"\[0, 1\)"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([-0.1]), r"\[0, 1\)"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([0.5], dtype=torch.float64), "u must"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([0.5, 0.5]), "u must"),
        (torch.tensor([[0.0, 0.0]]), torch.tensor([0.5]), "no positive"),
        (torch.tensor([[-0.5, 1.5]]), torch.tensor([0.5]), ">= 0"),
        (torch.tensor([[float("nan"), 1.0]]), torch.tensor([0.5]), "finite"),
    ],
)
def test_bad_draw_inputs_raise_named_errors(probs, u, match):
    with pytest.raises(SamplingError, match=match):
        draw(probs, u)
