"""Gates 0–2 of qualify on their models: mini by default, tiny selectable; gate 0 on mini fails
a cache path that sees one key too many; gate 2 on mini is reported (its verdict is tiny's)."""

from pathlib import Path

import pytest

from qualification import qualify, runtime_gate
from qualification.gates import FAIL, PASS
from reference import ops


def test_default_model_is_mini_and_tiny_stays_selectable():
    assert qualify.parse([]).model == "mini"
    assert runtime_gate.RuntimeGateConfig().model == "mini"
    q = qualify.parse(["--quick", "--model", "tiny", "--out", "/nonexistent"])
    assert (q.model, q.quick, q.out) == ("tiny", True, Path("/nonexistent"))
    with pytest.raises(SystemExit):
        qualify.parse(["--model", "huge"])
    tiny = qualify._models(q)
    assert tiny.name == "tiny" and tiny.refs["fp32"].cfg.name == "tiny"
    assert tiny.description == "tiny synthetic, weights seed 0"
    res = qualify.gate_reference_consistency(q, tiny)
    assert res.verdict == PASS and all(e.startswith("tiny ") for e in res.evidence), res.evidence
    mini = qualify._models(qualify.parse(["--quick"]))
    assert mini.name == "mini" and mini.refs["fp32"].cfg.name == "mini"
    assert mini.description.startswith("mini (models/mini, sha256 ")
    assert mini.prefix > mini.refs["fp32"].cfg.target.sliding_window  # windows clip


@pytest.mark.slow
def test_gate0_on_mini_fails_a_cache_path_one_key_too_wide(monkeypatch):
    """Broken variant: rows reading a cache (more keys than queries) see window + 1 keys; the
    no-cache pass (keys = queries) keeps the true window — cache_vs_recompute must fail."""
    q = qualify.parse(["--quick"])
    models = qualify._models(q)
    res = qualify.gate_reference_consistency(q, models)
    assert res.verdict == PASS, res.evidence
    real = ops.visible

    def cache_window_plus_one(q_pos, k_pos, window):
        wide = window is not None and k_pos.shape[0] > q_pos.shape[0]
        return real(q_pos, k_pos, window + 1 if wide else window)

    monkeypatch.setattr(ops, "visible", cache_window_plus_one)
    res = qualify.gate_reference_consistency(q, models)
    assert res.verdict == FAIL
    assert any("fp32" in e and "cache_vs_recompute" in e for e in res.evidence), res.evidence


@pytest.mark.slow
def test_gate2_reports_mini_and_keeps_the_tiny_verdict():
    q = qualify.parse(["--quick"])
    res = qualify.gate_stability(q, qualify._models(q))
    assert res.verdict == PASS and res.margin.endswith("(tiny)"), res.evidence
    mini = [e for e in res.evidence if e.startswith("mini (reported, not gated)")]
    assert len(mini) == 2 and all("% of allowed" in e for e in mini), res.evidence


def test_runtime_gate_refuses_a_prompt_that_does_not_wrap_the_ring():
    with pytest.raises(ValueError, match="do not wrap the mini target ring"):
        runtime_gate.setup(runtime_gate.RuntimeGateConfig(prompts=1, length=136), "twins")
    with pytest.raises(ValueError, match="RuntimeGateConfig.model"):
        runtime_gate.RuntimeGateConfig(model="huge")
