"""The record's warnings on hand-made load samples and pair counts (no run): high load at the
start or the end (the experiment's own threads not counted against it), a GPU run's milder
wording, load not measurable, few pairs, bad input; and the stated reason of MIN_PAIRS."""

import math

import pytest
from scipy import stats

from iquestrt.experiment.trust import (
    MIN_PAIRS,
    MachineLoad,
    TrustLimits,
    own_threads,
    warnings,
)

LIMITS = TrustLimits(min_pairs=10, high_load_per_cpu=0.5)


def test_idle_machine_and_enough_pairs_give_no_warning():
    assert warnings(MachineLoad(8, 8, 0.3, 8.2), 10, "cpu", LIMITS) == []


@pytest.mark.parametrize("start, end, warned", [
    (4.1, 0.0, True),  # 4.1 other threads on 8 CPUs at start: 0.51 per CPU
    (3.9, 0.0, False),
    (0.0, 8.0 + 4.1, True),  # the end: 8 own threads taken off, 4.1 others left
    (0.0, 8.0 + 3.9, False),
    (0.0, 2.0, False),  # fewer runnable than own threads: no other work at all
])
def test_high_load_at_start_or_end(start, end, warned):
    w = warnings(MachineLoad(8, 8, start, end), 12, "cpu", LIMITS)
    assert (len(w) == 1 and w[0].startswith("high machine load")) == warned, w
    if warned:
        assert "exceeds 0.5" in w[0] and "8 CPUs" in w[0] and "shared cores" in w[0]


def test_gpu_run_says_the_timings_are_less_exposed():
    w = warnings(MachineLoad(4, 1, 3.0, 1.0), 12, "cuda", LIMITS)
    assert len(w) == 1 and "only the host thread competes" in w[0]


def test_load_not_measured():
    w = warnings(MachineLoad(4, 1, None, None), 12, "cpu", LIMITS)
    assert len(w) == 1 and w[0].startswith("machine load not measured")
    assert warnings(MachineLoad(4, 1, None, 0.5), 12, "cpu", LIMITS) == []  # one is enough


@pytest.mark.parametrize("pairs, warned", [(0, True), (2, True), (9, True), (10, False),
                                           (40, False)])
def test_few_pairs(pairs, warned):
    w = warnings(MachineLoad(8, 1, 0.0, 1.0), pairs, "cpu", LIMITS)
    assert bool(w) == warned and all(x.startswith(f"few pairs: {pairs} ") for x in w)


def test_record_values_and_own_threads():
    d = MachineLoad(4, 2, 1.0, 5.0).as_dict(LIMITS)
    assert d == {"cpus": 4, "own_threads": 2, "load_1m_start": 1.0, "load_1m_end": 5.0,
                 "other_per_cpu_start": 0.25, "other_per_cpu_end": 0.75,
                 "high_load_per_cpu": 0.5}
    assert own_threads("cuda", 32, 16) == 1 and own_threads("cuda:1", 1, 16) == 1
    assert own_threads("cpu", 32, 16) == 16 and own_threads("cpu", 3, 16) == 3


def test_bad_input():
    with pytest.raises(ValueError, match="need cpus >= 1 and pairs >= 0"):
        warnings(MachineLoad(0, 1, 0.0, 0.0), 10, "cpu")
    with pytest.raises(ValueError, match="need cpus >= 1 and pairs >= 0"):
        warnings(MachineLoad(2, 1, 0.0, 0.0), -1, "cpu")


def _percentile_coverage(n: int) -> float:
    """Coverage of mean ± z·√((n−1)/n)·s/√n for normal data (the bootstrap's large-B limit)."""
    c = stats.norm.ppf(0.975) * math.sqrt((n - 1) / n)
    return 2 * stats.t.cdf(c, n - 1) - 1


def test_min_pairs_reason():
    # stated: below MIN_PAIRS a 95 % interval misses more than twice as often as it says
    assert 1 - _percentile_coverage(MIN_PAIRS) <= 2 * 0.05
    assert 1 - _percentile_coverage(MIN_PAIRS - 1) > 2 * 0.05
    assert _percentile_coverage(2) == pytest.approx(0.60, abs=0.01)
