"""The coverage gates fail on planted defects with evidence naming them (the mutants of
negative_controls/coverage_controls.py, restored on exit). That they pass unmutated, with
evidence, is qualify --quick's check (tests/qualification/test_qualification.py).
TP sharded sampling and the depth policy.

Each gate run decodes the mini model several times (10–25 s on one CPU thread, twins)."""

import pytest

from negative_controls import coverage_controls as cc
from negative_controls.control import gated
from qualification import depth_policy_gate, tp_sampling_gate

# --- tensor-parallel sharded sampling ------------------------------------------------------------




@pytest.mark.slow
def test_tp_sampling_gate_fails_when_the_merge_drops_the_last_shard():
    ok, ev = gated(tp_sampling_gate.run, cc.sharded_merge_drops_last_shard)(True)
    assert not ok
    for case in ("shipped", "tied"):
        for n in (2, 4, 8):
            line = next(e for e in ev if e.startswith(f"{case}, N={n}: "))
            assert "first differing sample call" in line and "sharded vs unsharded" in line


@pytest.mark.slow
def test_tp_sampling_gate_fails_when_ties_go_to_the_higher_shard():
    ok, ev = gated(tp_sampling_gate.run, cc.sharded_ties_to_higher_shard)(True)
    assert not ok
    # only the tied case holds equal z across shards
    assert [e.split(":")[0] for e in ev[:-1]] == ["tied, N=2", "tied, N=4", "tied, N=8"], ev
    assert all("first differing sample call 0 (TARGET_SAMPLE, 1 live rows): sharded vs "
               "unsharded sampler: ids differ at live row 0" in e for e in ev[:-1]), ev


# --- adaptive depth policy ----------------------------------------------------------------------




@pytest.mark.slow
def test_depth_policy_gate_fails_on_a_raised_device_threshold():
    """At qualify --quick's configuration, the one the quick test runs to a pass: the mutant and
    the pass are one negative control."""
    quick = depth_policy_gate.QUICK
    ok, ev = gated(lambda: depth_policy_gate.run(quick), cc.device_depth_threshold_raised)(True)
    assert not ok
    assert len(ev) == 3, ev
    for e, name in zip(ev[:2], ("fitted", "prior"), strict=True):
        assert e.startswith(f"{name} policy, ") and "after 3 drafts the device stopped, the " \
            "reference says more" in e, ev
