"""Paired bootstrap intervals (iquestrt/experiment/bootstrap.py) on synthetic data with a known
ratio. The broken variant, resampling the two arms with independent indices (unpaired), is
built here from the same primitives and must give a visibly wider interval and fail the coverage
band."""

from __future__ import annotations

import math

import pytest
import torch

from iquestrt.experiment.bootstrap import (
    mean_difference,
    percentile_interval,
    ratio_of_means,
    resample_indices,
)

# Prompt-to-prompt spread (times differ 10x between pairs), exactly representable values.
CTRL = [3.0, 50.0, 7.0, 200.0, 11.0, 90.0, 4.0, 130.0, 25.0, 60.0, 9.0, 300.0]


def _unpaired_ratio(ctrl, cand, resamples, seed):
    """Broken on purpose: the arms are resampled independently, losing the pairing."""
    a = torch.tensor(ctrl, dtype=torch.float64)
    b = torch.tensor(cand, dtype=torch.float64)
    ia = resample_indices(len(ctrl), resamples, seed)
    ib = resample_indices(len(ctrl), resamples, seed + 1)
    return percentile_interval(float(b.sum() / a.sum()), b[ib].sum(1) / a[ia].sum(1), 0.95)


def test_exact_ratio_gives_a_point_interval():
    """cand = 0.75 · ctrl in every pair: every resampled Σcand/Σctrl is exactly 0.75 (the sums
    are exact in binary64), so the paired interval is the point 0.75; unpaired it is wide."""
    cand = [0.75 * x for x in CTRL]
    iv = ratio_of_means(CTRL, cand, resamples=4000, seed=3)
    assert (iv.estimate, iv.lo, iv.hi) == (0.75, 0.75, 0.75)
    broken = _unpaired_ratio(CTRL, cand, 4000, 3)
    assert broken.hi - broken.lo > 0.5, broken


def test_identical_arms_difference_is_exactly_zero():
    acc = [2.5, 1.75, 3.0, 2.0, 1.0]
    iv = mean_difference(acc, acc, resamples=1000, seed=0)
    assert (iv.estimate, iv.lo, iv.hi) == (0.0, 0.0, 0.0)
    iv = mean_difference(acc, [x + 0.25 for x in acc], resamples=1000, seed=0)
    assert (iv.estimate, iv.lo, iv.hi) == (0.25, 0.25, 0.25)


def _coverage(paired: bool, m=400, n=24, resamples=2000, ratio=0.9, s_base=0.5, s_noise=0.05):
    """m synthetic experiments: ctrl_i lognormal(0, s_base) per pair, cand_i = ratio · ctrl_i ·
    exp(ε_i), ε ~ N(0, s_noise²). The population ratio of means is ratio · E[exp ε] =
    ratio · exp(s_noise²/2). → (share of intervals covering it, median width, expected width)."""
    g = torch.Generator().manual_seed(11)
    base = torch.exp(s_base * torch.randn(m, n, generator=g, dtype=torch.float64))
    cand = ratio * base * torch.exp(s_noise * torch.randn(m, n, generator=g, dtype=torch.float64))
    truth = ratio * math.exp(s_noise**2 / 2)
    cover, widths = 0, []
    for j in range(m):
        c, x = base[j].tolist(), cand[j].tolist()
        iv = (ratio_of_means(c, x, resamples=resamples, seed=j) if paired
              else _unpaired_ratio(c, x, resamples, j))
        cover += iv.contains(truth)
        widths.append(iv.hi - iv.lo)
    # delta method: sd(Σcand/Σctrl) ≈ ratio · s_noise · sqrt(E b²) / (E b · sqrt(n)), b lognormal
    sd = ratio * s_noise * math.exp(s_base**2 / 2) / math.sqrt(n)
    return cover / m, sorted(widths)[m // 2], 2 * 1.959964 * sd


def test_coverage_of_a_known_ratio():
    """Band for the share of 95% intervals covering the true ratio, over 400 independent
    synthetic experiments (seeded, so deterministic): [0.90, 0.98] = 0.95 ± 3 binomial sd
    (0.011 each at m = 400), widened below by 0.02 for the percentile bootstrap's known
    small-sample undercoverage at n = 24 (α of the binomial part: 0.3%)."""
    cover, width, expected = _coverage(paired=True)
    assert 0.90 <= cover <= 0.98, cover
    assert 0.75 <= width / expected <= 1.1, (width, expected)
    b_cover, b_width, _ = _coverage(paired=False)
    assert not 0.90 <= b_cover <= 0.98, b_cover  # the unpaired variant over-covers …
    assert b_width > 5 * width, (b_width, width)  # … because its intervals are much wider


def test_resampling_is_seeded_and_deterministic():
    a = resample_indices(7, 50, 4)
    assert torch.equal(a, resample_indices(7, 50, 4))
    assert not torch.equal(a, resample_indices(7, 50, 5))
    assert a.shape == (50, 7) and int(a.min()) >= 0 and int(a.max()) <= 6
    x, y = [1.0, 2.0, 4.0], [1.5, 1.0, 5.0]
    assert ratio_of_means(x, y, resamples=300, seed=9) == ratio_of_means(x, y, resamples=300,
                                                                         seed=9)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: ratio_of_means([1.0, 2.0], [1.0]), "2 control and 1 candidate values"),
    (lambda: ratio_of_means([1.0, 0.0], [1.0, 1.0]), "positive control values"),
    (lambda: ratio_of_means([1.0, float("nan")], [1.0, 1.0]), "control must be a list of finite"),
    (lambda: mean_difference([], []), "at least 1 pair"),
    (lambda: ratio_of_means([1.0], [1.0], resamples=0), "resamples must be >= 1"),
    (lambda: ratio_of_means([1.0], [1.0], level=1.0), r"level must be in \(0, 1\)"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
