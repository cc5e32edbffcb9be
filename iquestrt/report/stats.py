"""Uncertainty of the report's rates.

A per-depth acceptance is a binomial rate: k rounds accepting ≥ j drafts out of n rounds that
drafted ≥ j. Its interval is Wilson's score interval (scipy.stats.binomtest(...).proportion_ci
with method="wilson"). Unlike the normal approximation p̂ ± z√(p̂(1 − p̂)/n) it stays inside
[0, 1] and keeps a width at k = 0 or k = n: 2 of 2 gives [0.34, 1], not [1, 1].
"""

from __future__ import annotations

import math

from scipy import stats

# Points resting on fewer rounds are flagged (hollow marker, listed in the summary): at n = 20
# the Wilson 95 % interval of a rate near 0.5 is already ±0.20 wide, wider with fewer rounds,
# so such a point can move by more than the differences between depths the report compares.
FEW_ROUNDS = 20
LEVEL = 0.95


def wilson_interval(successes: int, trials: int, level: float = LEVEL) -> tuple[float, float]:
    """(lo, hi) of a binomial rate successes / trials; (nan, nan) when trials == 0."""
    k, n = int(successes), int(trials)
    if k != successes or n != trials:
        raise ValueError(f"wilson_interval: counts must be integers, got {successes}/{trials}")
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= trials, got {k}/{n}")
    if not 0 < level < 1:
        raise ValueError(f"wilson_interval: level must be in (0, 1), got {level}")
    if n == 0:
        return math.nan, math.nan
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)
