"""The negative-control harness: controls are caught; a control that breaks nothing is reported
as not caught and fails the run."""

import pytest

from negative_controls import (
    combine_controls,
    readiness_controls,
    router_controls,
    sampler_controls,
)
from negative_controls import run as nc
from negative_controls.control import Control


@pytest.mark.slow
def test_selected_controls_are_caught(capsys):
    assert nc.main(["--only", "window_plus_one", "sink_dropped", "ratio_inverted"]) == 0
    out = capsys.readouterr().out
    assert "3 of 3 controls caught" in out


@pytest.mark.slow
def test_a_harmless_control_is_not_caught(monkeypatch, capsys):
    ring = next(c for c in nc.ALL if c.name == "window_plus_one")
    harmless = Control("harmless", ring.gate, "mutates nothing", lambda mutated: ring.run(False))
    monkeypatch.setattr(nc, "ALL", (harmless,))
    assert nc.main([]) == 1
    assert "NOT CAUGHT" in capsys.readouterr().out


def test_a_failing_baseline_fails_the_run(monkeypatch, capsys):
    broken = Control("broken", "x", "baseline fails", lambda mutated: (False, ["always fails"]))
    monkeypatch.setattr(nc, "ALL", (broken,))
    assert nc.main([]) == 1
    assert "BASELINE FAILED" in capsys.readouterr().out


def test_a_control_that_crashes_is_not_a_catch(monkeypatch, capsys):
    """A mutated run that raises outside the runtime's and gates' own checks (here: a device
    mismatch, the bug this control had on the H200) is a broken control, not a catch; an
    EngineError (a fault the engine recorded) is a catch."""
    from iquestrt.engine import EngineError

    def crash(mutated):
        if mutated:
            raise RuntimeError("Expected all tensors to be on the same device")
        return True, ["fine"]

    def detected(mutated):
        if mutated:
            raise EngineError("round 3: non-finite target logits at depth 1")
        return True, ["fine"]

    monkeypatch.setattr(nc, "ALL", (Control("crash", "1 x", "crashes", crash),))
    assert nc.main([]) == 1
    assert "CONTROL BROKEN" in capsys.readouterr().out
    monkeypatch.setattr(nc, "ALL", (Control("detected", "1 x", "faults", detected),))
    assert nc.main([]) == 0
    assert "raised EngineError" in capsys.readouterr().out


def test_controls_of_one_gate_run_share_its_baseline(monkeypatch, capsys):
    """Two controls gated by the same run: one unmutated call, one call per mutant; a control of
    another run gets its own baseline. A shared baseline that fails fails both controls."""
    from contextlib import contextmanager

    from negative_controls.control import gated

    calls, state = [], {"broken": False, "gate_ok": True}

    def gate_run(tag):
        def run():
            calls.append((tag, state["broken"]))
            return state["gate_ok"] and not state["broken"], "-", ["evidence"]
        return run

    @contextmanager
    def breaks():
        state["broken"] = True
        try:
            yield
        finally:
            state["broken"] = False

    shared, other = gate_run("shared"), gate_run("other")
    controls = tuple(Control(n, "1 x", "m", gated(r, breaks))
                     for n, r in (("a", shared), ("b", shared), ("c", other)))
    monkeypatch.setattr(nc, "ALL", controls)
    assert nc.main([]) == 0
    assert sorted(calls) == sorted([("shared", False), ("shared", True), ("shared", True),
                                    ("other", False), ("other", True)])
    assert "3 of 3 controls caught" in capsys.readouterr().out
    calls.clear()
    state["gate_ok"] = False
    assert nc.main(["--only", "a", "b"]) == 1
    assert calls == [("shared", False)]  # failed once, reported for both, no mutant run
    out = capsys.readouterr().out
    assert "0 of 2 controls caught" in out
    assert "a: NOT CAUGHT (0s): BASELINE FAILED" in out and "b: NOT CAUGHT (0s): BASELINE" in out


def test_there_are_at_least_fifteen_controls_each_mapped_to_a_gate():
    names = [c.name for c in nc.ALL]
    assert len(names) == len(set(names)) >= 15
    assert all(c.gate[0].isdigit() and c.mutation for c in nc.ALL)
    gates = {c.name: c.gate for c in nc.ALL}
    assert gates["combine_without_lse_rescale"] == "2 stability bands"
    assert gates["top_k_top_p_order_swapped"] == "6 sampler gates"
    assert gates["nan_readiness_rearmed_too_early"] == "8 readiness protocol"
    assert gates["router_from_bf16_activation"] == "3b bit-exactness (runtime twins vs matched)"


# --- readiness, router, sampler-order and prefetch controls -------------------------------


@pytest.mark.slow
def test_readiness_and_router_controls_are_caught(capsys):
    assert nc.main(["--only", "nan_readiness_rearmed_too_early",
                    "router_from_bf16_activation"]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 controls caught" in out
    assert "stuck after" in out and "gate 1's FP32 band passes" in out


@pytest.mark.slow
def test_combine_control_is_caught_where_keys_span_two_splits():
    (control,) = combine_controls.CONTROLS
    assert control.run(False)[0]
    ok, evidence = control.run(True)
    # the interpreter's config deals 16-key tiles: positions < 16 have one split, unaffected
    assert not ok and "outside: positions [16, 17," in evidence[0]


@pytest.mark.slow
def test_order_swap_fails_the_sampler_gate_on_probabilities():
    """The registered control's wrapper on a smaller sampler gate (the full one runs in
    `nox -s negative_controls`): unmutated passes, top-p before top-k fails, the patch is
    undone afterwards."""
    import kernels.sampler as ks
    from qualification.sampler_gate import SamplerGateConfig
    from reference.config import SamplingDefaults

    real = ks.sample
    small = SamplerGateConfig(vocab=131, settings=(SamplingDefaults(0.7, 8, 0.9),))
    run = sampler_controls._gate(sampler_controls._top_p_before_top_k, small)
    assert run(False)[0]
    ok, evidence = run(True)
    assert not ok and "served probabilities" in evidence[0]
    assert ks.sample is real


@pytest.mark.slow
def test_router_mutant_stays_inside_the_tolerance_band_but_not_the_bits():
    from qualification import bitexact_gate

    setup = bitexact_gate.build()
    tokens = bitexact_gate.prompt(bitexact_gate.BitexactGateConfig(),
                                  setup.refs["matched"].cfg.target.vocab_size)
    for mutated in (False, True):
        band_ok, worst, evidence = router_controls.tolerance_band(setup, mutated)
        assert band_ok and worst < 1, evidence
    assert bitexact_gate.compare(setup, tokens)[0]
    with router_controls.router_from_bf16_activation():
        exact, line = bitexact_gate.compare(setup, tokens)
    assert not exact and "NOT bit-exact" in line
    assert bitexact_gate.compare(setup, tokens)[0], "the patch was not undone"


def test_patches_are_undone_when_the_gate_raises():
    import kernels.attention as ka
    from iquestrt.ops import TwinOps
    from kernels.readiness import RingPolicy
    from reference import ops

    before = (ops.attention, ka.attention_combine, RingPolicy.rearm_slot, TwinOps.attn_tail)
    for patch in (combine_controls._attention_on_kernels(combine_controls.combine_without_rescale),
                  readiness_controls._patched_rearm(),
                  router_controls.router_from_bf16_activation()):
        with pytest.raises(RuntimeError, match="gate crashed"), patch:
            raise RuntimeError("gate crashed")
    assert before == (ops.attention, ka.attention_combine, RingPolicy.rearm_slot,
                      TwinOps.attn_tail)


@pytest.mark.slow
def test_prefetch_overriding_routing_is_caught_by_the_on_off_gate():
    from negative_controls import prefetch_controls

    ok, evidence = prefetch_controls._gate(False)
    assert ok, evidence
    ok, evidence = prefetch_controls._gate(True)
    assert not ok and any("differ" in e for e in evidence), evidence
