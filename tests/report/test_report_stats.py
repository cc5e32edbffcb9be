"""Wilson intervals against published values and the closed form at the edge counts, bad input,
and the reason given for the few-rounds flag."""

import math

import pytest

from iquestrt.report.stats import FEW_ROUNDS, wilson_interval

Z95 = 1.959963984540054  # the standard normal's 0.975 quantile


# Newcombe, "Two-sided confidence intervals for the single proportion: comparison of seven
# methods", Statistics in Medicine 17 (1998) 857-872, Table I, method 3 (Wilson score, 95 %),
# given there to 4 decimals
@pytest.mark.parametrize("k, n, lo, hi", [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605),
                                          (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)])
def test_wilson_matches_published_values(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got[0] == pytest.approx(lo, abs=5e-5) and got[1] == pytest.approx(hi, abs=5e-5)


@pytest.mark.parametrize("n", [1, 2, 7, 20, 1000])
def test_all_or_none_keeps_a_width(n):
    # at k = n the score equation gives lo = n / (n + z²) exactly; k = 0 mirrors it
    lo, hi = wilson_interval(n, n)
    assert hi == pytest.approx(1.0, abs=1e-12)
    assert lo == pytest.approx(n / (n + Z95**2), rel=1e-9)
    lo0, hi0 = wilson_interval(0, n)
    assert lo0 == pytest.approx(0.0, abs=1e-12)
    assert hi0 == pytest.approx(Z95**2 / (n + Z95**2), rel=1e-9)


@pytest.mark.parametrize("k, n", [(1, 3), (10, 20), (59, 90)])
def test_a_higher_level_gives_a_wider_interval_around_the_rate(k, n):
    widths = []
    for level in (0.8, 0.95, 0.99):
        lo, hi = wilson_interval(k, n, level)
        assert 0.0 <= lo < k / n < hi <= 1.0
        widths.append(hi - lo)
    assert widths == sorted(widths) and widths[0] < widths[-1]
    assert all(math.isnan(v) for v in wilson_interval(0, 0))


@pytest.mark.parametrize("args, match", [
    ((3, 2), "0 <= successes <= trials"), ((-1, 2), "0 <= successes <= trials"),
    ((1, -1), "0 <= successes <= trials"), ((1.5, 3), "must be integers"),
    ((1, 2, 1.0), "level must be in"), ((1, 2, 0.0), "level must be in"),
])
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        wilson_interval(*args)


def test_few_rounds_reason():
    # the constant's stated reason: at n = FEW_ROUNDS a rate of 0.5 is already ±0.20 wide;
    # Wilson half-width at p̂ = 1/2: z·√(n/4 + z²/4) / (n + z²)
    n = FEW_ROUNDS
    half = Z95 * math.sqrt(n / 4 + Z95**2 / 4) / (n + Z95**2)
    assert half == pytest.approx(0.20, abs=0.005)
    lo, hi = wilson_interval(n // 2, n)
    assert (hi - lo) / 2 == pytest.approx(half, rel=1e-9)
