"""The coverage gates fail on planted defects with evidence naming them (the mutants of
negative_controls/coverage_controls.py, restored on exit). That they pass unmutated, with
evidence, is qualify --quick's check (tests/qualification/test_qualification.py).
Engine reuse and seed width.

Each gate run decodes the mini model several times (10–25 s on one CPU thread, twins)."""

import pytest

from negative_controls import coverage_controls as cc
from negative_controls.control import gated
from qualification import reuse_gate, seed_gate

# --- engine reuse ------------------------------------------------------------------------------




@pytest.mark.slow
def test_reuse_gate_fails_when_the_sampling_values_are_kept():
    ok, ev = gated(reuse_gate.run, cc.reused_engine_keeps_sampling_values)(True)
    assert not ok
    assert ev[0].startswith("request 2 (") and "T 0.7" in ev[0], ev
    assert "tokens differ from a fresh engine's from token" in ev[0], ev
    assert "round records differ from a fresh engine's from round" in ev[0], ev


@pytest.mark.slow
def test_reuse_gate_fails_when_the_stop_ids_are_kept():
    ok, ev = gated(reuse_gate.run, cc.reused_engine_keeps_stop_ids)(True)
    assert not ok
    # request 3 emits request 2's stop id 282: the device ends it where the host does not
    assert len(ev) == 2 and ev[0].startswith("request 3 (") and "stop ids [4]" in ev[0], ev
    assert "the device marked the request done" in ev[0], ev


# --- seed width --------------------------------------------------------------------------------




@pytest.mark.slow
def test_seed_gate_fails_on_a_seed_cut_to_32_bits():
    ok, ev = gated(seed_gate.run, cc.seed_low_32_bits)(True)
    assert not ok
    for bit in (32, 48, 63):
        assert any(e.startswith(f"bit {bit}: seeds 0x2545f4914f6cdd1d and ")
                   and "give the same 16 tokens" in e for e in ev), ev
    assert sum("are identical at all 192" in e for e in ev) == 3, ev


@pytest.mark.slow
def test_seed_gate_fails_when_the_device_drops_bit_63():
    ok, ev = gated(seed_gate.run, cc.device_seed_bit_63_dropped)(True)
    assert not ok
    bad = ev[:-1]
    assert bad and all(e.startswith("seed 0xa545f4914f6cdd1d: ") for e in bad), ev
    assert any("read back as 0x2545f4914f6cdd1d (host_seed)" in e for e in bad), ev
    assert any("tokens differ from the matched reference's from token" in e for e in bad), ev


