"""The coverage gates — engine reuse, seed width, TP sharded sampling, adaptive depth policy —
pass on their default configs with evidence, and each fails on a planted defect with evidence
naming it (the mutants of negative_controls/coverage_controls.py, restored on exit).

Each gate run decodes the mini model several times (10–25 s on one CPU thread, twins)."""

import re

from negative_controls import coverage_controls as cc
from qualification import depth_policy_gate, reuse_gate, seed_gate, tp_sampling_gate


def _run(gate, mutant=None):
    if mutant is None:
        return gate.run()
    with mutant():
        return gate.run()


# --- engine reuse ------------------------------------------------------------------------------


def test_reuse_gate_passes():
    ok, margin, ev = reuse_gate.run()
    assert ok and margin == "exact", ev
    assert "program built 1, reused 2" in ev[-1] and "equals a fresh engine's" in ev[-1], ev
    assert re.search(r"; 2 \d+ tokens / \d+ rounds, stop;", ev[-1]), ev  # ends on a stop id


def test_reuse_gate_fails_when_the_sampling_values_are_kept():
    ok, _, ev = _run(reuse_gate, cc.reused_engine_keeps_sampling_values)
    assert not ok
    assert ev[0].startswith("request 2 (") and "T 0.7" in ev[0], ev
    assert "tokens differ from a fresh engine's from token" in ev[0], ev
    assert "round records differ from a fresh engine's from round" in ev[0], ev


def test_reuse_gate_fails_when_the_stop_ids_are_kept():
    ok, _, ev = _run(reuse_gate, cc.reused_engine_keeps_stop_ids)
    assert not ok
    # request 3 emits request 2's stop id 282: the device ends it where the host does not
    assert len(ev) == 2 and ev[0].startswith("request 3 (") and "stop ids [4]" in ev[0], ev
    assert "the device marked the request done" in ev[0], ev


# --- seed width --------------------------------------------------------------------------------


def test_seed_gate_passes():
    ok, margin, ev = seed_gate.run()
    assert ok and margin == "exact", ev
    for bit, seed in ((32, "0x2545f4904f6cdd1d"), (48, "0x2544f4914f6cdd1d"),
                      (63, "0xa545f4914f6cdd1d")):
        assert f"bit {bit} ({seed}): uniforms differ at 192/192, tokens differ from token" \
            in ev[-1], ev
    assert "every seed reproduces and equals the reference" in ev[-1], ev


def test_seed_gate_fails_on_a_seed_cut_to_32_bits():
    ok, _, ev = _run(seed_gate, cc.seed_low_32_bits)
    assert not ok
    for bit in (32, 48, 63):
        assert any(e.startswith(f"bit {bit}: seeds 0x2545f4914f6cdd1d and ")
                   and "give the same 16 tokens" in e for e in ev), ev
    assert sum("are identical at all 192" in e for e in ev) == 3, ev


def test_seed_gate_fails_when_the_device_drops_bit_63():
    ok, _, ev = _run(seed_gate, cc.device_seed_bit_63_dropped)
    assert not ok
    bad = ev[:-1]
    assert bad and all(e.startswith("seed 0xa545f4914f6cdd1d: ") for e in bad), ev
    assert any("read back as 0x2545f4914f6cdd1d (host_seed)" in e for e in bad), ev
    assert any("tokens differ from the matched reference's from token" in e for e in bad), ev


# --- tensor-parallel sharded sampling ------------------------------------------------------------


def test_tp_sampling_gate_passes():
    ok, margin, ev = tp_sampling_gate.run()
    assert ok and margin == "exact", ev
    assert "sharded == unsharded at every N" in ev[-1], ev
    tied = ev[-1].split("tied (")[1]
    for n in (2, 4, 8):  # every row straddles a boundary and ties at the top-K cut
        assert re.search(rf"N={n} (\d+)/\1 rows straddle, \1 cut ties", tied), ev


def test_tp_sampling_gate_fails_when_the_merge_drops_the_last_shard():
    ok, _, ev = _run(tp_sampling_gate, cc.sharded_merge_drops_last_shard)
    assert not ok
    for case in ("shipped", "tied"):
        for n in (2, 4, 8):
            line = next(e for e in ev if e.startswith(f"{case}, N={n}: "))
            assert "first differing sample call" in line and "sharded vs unsharded" in line


def test_tp_sampling_gate_fails_when_ties_go_to_the_higher_shard():
    ok, _, ev = _run(tp_sampling_gate, cc.sharded_ties_to_higher_shard)
    assert not ok
    # only the tied case holds equal z across shards
    assert [e.split(":")[0] for e in ev[:-1]] == ["tied, N=2", "tied, N=4", "tied, N=8"], ev
    assert all("first differing sample call 0 (TARGET_SAMPLE, 1 live rows): sharded vs "
               "unsharded sampler: ids differ at live row 0" in e for e in ev[:-1]), ev


# --- adaptive depth policy ----------------------------------------------------------------------


def test_depth_policy_gate_passes():
    ok, margin, ev = depth_policy_gate.run()
    assert ok and margin.startswith("closest decision |s - threshold| = "), ev
    assert "every device decision equals the reference's" in ev[-1], ev
    assert "fitted (threshold 0.388902)" in ev[-1] and "prior (threshold 0.125)" in ev[-1], ev


def test_depth_policy_gate_fails_on_a_raised_device_threshold():
    ok, _, ev = _run(depth_policy_gate, cc.device_depth_threshold_raised)
    assert not ok
    assert len(ev) == 3, ev
    for e, name in zip(ev[:2], ("fitted", "prior"), strict=True):
        assert e.startswith(f"{name} policy, ") and "after 3 drafts the device stopped, the " \
            "reference says more" in e, ev
