"""The qualification runner: goldens name the first differing round, reports are whole."""

import json

import pytest
import torch

from qualification import goldens
from qualification.gates import FAIL, PASS, GateResult, write_reports
from qualification.qualify import main


def test_goldens_name_the_first_differing_round():
    want = {"a": {"tokens": "t", "rounds": ["r0", "r1", "r2"]}, "b": {"tokens": "u", "rounds": []}}
    assert goldens.compare(want, want) == []
    got = {"a": {"tokens": "x", "rounds": ["r0", "R1", "r2"]}, "b": want["b"]}
    assert goldens.compare(got, want) == ["a: first differing round 1 (of 3 golden)"]
    shorter = {"a": {"tokens": "t", "rounds": ["r0"]}, "b": want["b"]}
    assert goldens.compare(shorter, want) == ["a: first differing round 1 (of 3 golden)"]
    assert goldens.compare({"a": want["a"]}, want) == ["b: case missing"]


def test_reports_are_written_whole(tmp_path):
    res = [GateResult("g1", PASS, "10% of band", ["fine"]), GateResult("g2", FAIL, "x", ["bad"])]
    meta = {"revision": "r", "command": "c", "environment": {"device": "cpu"}}
    j, m = write_reports(tmp_path, res, meta)
    assert json.loads(j.read_text())["gates"][1]["verdict"] == FAIL
    assert "## g2: FAIL" in m.read_text()
    assert not list(tmp_path.glob("*.partial"))


# Gates whose `qualify --quick` run another test performs, in the same configuration, and
# asserts to pass: CI runs each gate to a verdict once. gate name → (test module, test function)
BOUND_ELSEWHERE = {
    "runtime": ("tests.qualification.test_qualification",
                "test_runtime_gate_passes_and_fails_a_runtime_without_sinks"),
    "sampler": ("tests.qualification.test_qualification",
                "test_sampler_gate_fails_a_sampler_keyed_without_position"),
    # the unmutated runs of the engine controls (draft_depth_state_not_advanced,
    # rollback_skipped_after_ring_wrap, padding_row_leaks_into_live_rows) are these gates' runs
    "acceptance": ("tests.qualification.test_engine_controls",
                   "test_engine_controls_are_caught_and_the_unmutated_engine_passes"),
    "engine_caches": ("tests.qualification.test_engine_controls",
                      "test_engine_controls_are_caught_and_the_unmutated_engine_passes"),
    "width": ("tests.qualification.test_engine_controls",
              "test_engine_controls_are_caught_and_the_unmutated_engine_passes"),
}


def test_every_gate_is_run_to_a_pass_by_some_test():
    import importlib

    from qualification.qualify import GATE_NAMES

    assert set(BOUND_ELSEWHERE) < set(GATE_NAMES)
    for module, test in BOUND_ELSEWHERE.values():
        assert callable(getattr(importlib.import_module(module), test)), (module, test)


@pytest.mark.slow
def test_qualify_quick_passes_and_reports(tmp_path, capsys):
    from qualification.qualify import GATE_NAMES

    only = [g for g in GATE_NAMES if g not in BOUND_ELSEWHERE]
    # in this process, under the harness's interpreter speed-ups (gate processes: test_gate_pool)
    assert main(["--quick", "--out", str(tmp_path), "--jobs", "1", "--only", *only]) == 0
    out = capsys.readouterr().out
    assert "0 reference consistency" in out and "7b adaptive depth decisions" in out
    rep = json.loads((tmp_path / "qualify.json").read_text())
    gates = rep["gates"]
    built = [g["verdict"] for g in gates if g["verdict"] not in ("not built", "GPU only",
                                                                 "not run")]
    assert len(built) == len(only) - (not torch.cuda.is_available()) and set(built) == {"pass"}
    assert rep["model"].startswith("mini (models/mini")
    assert rep["subset"].startswith("only ") and "NOT a qualification run" in rep["subset"]
    ev = {g["gate"]: " ".join(g["evidence"]) for g in gates}
    assert "program built 1, reused 2" in ev["3f engine reuse"]
    assert "uniforms differ at 192/192" in ev["6b seed width"]
    assert "every seed reproduces and equals the reference" in ev["6b seed width"]
    assert "1b lockstep kernels vs twins" in ev and "comparisons over" in ev[
        "1b lockstep kernels vs twins"]
    assert "every device decision equals the reference's" in ev["7b adaptive depth decisions"]


# --- gates fail on planted defects ----------------------------------------------------------


def _tiny_models():
    from reference.config import preset
    from reference.model import ReferenceModel
    from reference.synthetic import synthetic_params

    cfg = preset("tiny")
    params = synthetic_params(cfg, 0)
    return {p: ReferenceModel(cfg, params, p) for p in ("fp32", "bf16")}, params


def test_stability_gate_passes_fold_and_fails_a_dropped_sink():
    import torch

    from qualification import stability
    from reference.model import ReferenceModel

    models, params = _tiny_models()
    cfg = stability.StabilityConfig(prompts=1)

    def logits_of(model):
        return lambda t: model.target(t, torch.arange(len(t)), model.new_target_cache()).logits

    fold = ReferenceModel(models["bf16"].cfg, params, "bf16-fold")
    ok, worst, _ = stability.run(models["fp32"], models["bf16"], logits_of(fold), cfg)
    assert ok and worst < 1
    broken = dict(params)
    for name in broken:
        if name.endswith("sink_k"):
            broken[name] = torch.zeros_like(broken[name])
    no_sink = ReferenceModel(models["bf16"].cfg, broken, "bf16")
    ok, worst, evidence = stability.run(models["fp32"], models["bf16"], logits_of(no_sink), cfg)
    assert not ok and worst > 1, evidence


@pytest.mark.slow
def test_sampler_gate_fails_a_sampler_keyed_without_position(monkeypatch):
    """The mutant runs the gate without its sampling settings: their checks draw at the same
    positions on both sides (a sampler keyed without position passes them); the uniform rows'
    rng check is the one that must catch it."""
    import kernels.sampler as ks
    from qualification import sampler_gate

    ok, evidence = sampler_gate.run()
    assert ok, evidence
    real = ks.sample

    def no_position(logits, params, seed, positions, *a, **kw):
        return real(logits, params, seed, positions * 0, *a, **kw)

    monkeypatch.setattr(ks, "sample", no_position)
    ok, evidence = sampler_gate.run(sampler_gate.SamplerGateConfig(settings=()))
    assert not ok and any("position" in e for e in evidence), evidence


@pytest.fixture(scope="module")
def ring_case_unmutated():
    """Gate 4's first case on the ring it specifies: (ok, evidence), the pass each mutant below
    is told apart from (run once for all of them)."""
    from qualification import ring_gate

    g = ring_gate.RingGateConfig()
    return ring_gate.check_case(g.cases[0], g, ring_gate.gate_device())


@pytest.mark.parametrize(
    "mutant, message",
    [
        (dict(pad=0), "refused"),  # a ring of exactly `window` slots
        (dict(window=17, pad=7), "did not attend"),  # window one too wide
        (dict(window=15, pad=9), "did not attend"),  # window one too narrow
    ],
)
@pytest.mark.slow
def test_ring_gate_catches_ring_mutants(mutant, message, ring_case_unmutated):

    from qualification import ring_gate

    ok, evidence = ring_case_unmutated
    assert ok, evidence
    g, dev = ring_gate.RingGateConfig(), ring_gate.gate_device()
    ok, evidence = ring_gate.check_case(g.cases[0], g, dev, **mutant)
    assert not ok and message in evidence[0], evidence


@pytest.mark.slow
def test_runtime_gate_passes_and_fails_a_runtime_without_sinks(monkeypatch):
    from iquestrt import ops as rt_ops
    from qualification import runtime_gate

    cfg = runtime_gate.RuntimeGateConfig(prompts=1)
    ok, margin, evidence = runtime_gate.run(cfg, ops="twins")  # the CPU twins on any machine
    assert ok and margin.startswith("bit-exact"), evidence
    real = rt_ops.TwinOps.attention

    def no_sink(self, q, cache, positions, live, sink_k, scale):
        return real(self, q, cache, positions, live, None, scale)

    monkeypatch.setattr(rt_ops.TwinOps, "attention", no_sink)
    ok, margin, evidence = runtime_gate.run(cfg, ops="twins")
    assert not ok and "NOT bit-exact" in evidence[0], evidence
    # the FP32 band alone (the GPU's criterion) catches it too on mini (qualify's default)
    assert cfg.model == "mini" and "outside: positions" in evidence[1], evidence


@pytest.mark.slow
def test_per_layer_report_localizes_a_defect(tmp_path):
    """runtime_gate._per_layer: the runtime's attention inputs vs the FP32 reference, per layer.
    Scaling layer 4's attention_norm weight in the runtime by 1.5 leaves layers 0–3 as they were
    and makes layer 4's input the first with a large error (the report names where it starts)."""
    from iquestrt.config import RuntimeConfig
    from iquestrt.engine import Engine
    from qualification.runtime_gate import _per_layer
    from reference.checkpoint import load_checkpoint, make_synthetic_checkpoint
    from reference.model import ReferenceModel

    make_synthetic_checkpoint(tmp_path / "t", "tiny", 0, fmt="fp8")
    ck = load_checkpoint(tmp_path / "t")
    eng = Engine.from_checkpoint(tmp_path / "t", RuntimeConfig(ring_pad=8))
    ref = ReferenceModel(ck.cfg, ck.dequantized(), "fp32")
    toks = list(range(3, 23))
    base = _per_layer(eng, ref, toks)
    assert [r[0] for r in base] == list(range(8)) and base[0][2] < 1e-2
    eng.w.layers[4].attn.attention_norm.mul_(1.5)
    bad = _per_layer(eng, ref, toks)
    assert [r[2] for r in bad[:4]] == [r[2] for r in base[:4]]
    assert bad[4][2] > 3 * base[4][2] and bad[4][2] > 0.3


def test_schedule_gate_is_gpu_only_and_never_a_cpu_pass(monkeypatch):
    """On a machine without a GPU the scheduling-pairs gate reports 'GPU only' (not a pass, not a
    failure); qualify's exit status ignores it."""
    from qualification import qualify, schedule_gate
    from qualification.gates import GPU_ONLY

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, margin, ev = schedule_gate.run()
    assert ok is None and "needs a CUDA GPU" in ev[0]
    res = qualify.gate_schedule(None, None)
    assert res.verdict == GPU_ONLY


@pytest.mark.gpu
def test_schedule_gate_passes_on_the_gpu():
    from qualification import schedule_gate

    ok, _, ev = schedule_gate.run()
    assert ok is True, ev
    assert len(ev) == 2 and all("variants identical" in e for e in ev)


@pytest.mark.gpu
def test_runtime_gate_on_the_gpu_excuses_flips_but_not_a_missing_sink(monkeypatch):
    """The kernels path on mini: positions outside the FP32 band pass only through legal
    routing flips; the same engine without sink keys fails the matched band."""
    from iquestrt import ops as rt_ops
    from qualification import runtime_gate

    cfg = runtime_gate.RuntimeGateConfig(prompts=1)
    ok, _, ev = runtime_gate.run(cfg)
    assert ok, ev
    assert any("routing flips vs matched" in e and "0 not near-ties" in e for e in ev), ev
    real, real_q = rt_ops.KernelOps.attention, rt_ops.KernelOps.attention_q

    def no_sink(self, q, cache, positions, live, sink_k, scale):
        return real(self, q, cache, positions, live, None, scale)

    def no_sink_q(self, q, cache, positions, live, sink_k, scale):  # the fused-quant path
        return real_q(self, q, cache, positions, live, None, scale)

    monkeypatch.setattr(rt_ops.KernelOps, "attention", no_sink)
    monkeypatch.setattr(rt_ops.KernelOps, "attention_q", no_sink_q)
    ok, _, ev = runtime_gate.run(cfg)
    assert not ok and any("matched band: FAIL" in e for e in ev), ev


def test_goldens_are_keyed_by_platform(tmp_path, monkeypatch, capsys):
    """A platform with its own entry compares against it; another platform compares against the
    primary and, on a mismatch, is told why and how to record its own (never silently)."""
    stored = {"cases": {"a": {"tokens": "t", "rounds": ["r0"]}}, "platform": "P",
              "platforms": {"Q": {"cases": {"a": {"tokens": "u", "rounds": ["q0"]}}, "why": "w"}}}
    assert goldens.expected(stored, "Q") == (stored["platforms"]["Q"]["cases"],
                                             "this platform's entry (Q)")
    assert goldens.expected(stored, "R")[0] is stored["cases"]
    assert goldens.hint(stored, "P") is None and goldens.hint(stored, "Q") is None
    assert "--this-platform" in goldens.hint(stored, "R")
    # the command: a foreign platform's entry is added next to the primary, which stays
    path = tmp_path / "g.json"
    path.write_text(json.dumps(stored))
    monkeypatch.setattr(goldens, "GOLDEN_FILE", path)
    fake = {"a": {"tokens": "v", "rounds": ["x0"]}}
    monkeypatch.setattr(goldens, "digests", lambda models=None: fake)
    monkeypatch.setattr(goldens, "platform_key", lambda: "R")
    assert goldens.main([]) == 1
    assert "--this-platform" in capsys.readouterr().out
    assert goldens.main(["--update", "--this-platform", "--why", "test"]) == 0
    new = json.loads(path.read_text())
    assert new["cases"] == stored["cases"] and new["platforms"]["R"]["cases"] == fake
    assert goldens.main([]) == 0


def test_only_runs_a_subset_and_says_so(tmp_path, capsys):
    """`qualify --only`: the other gates are "not run", the report is titled a subset, and an
    unknown gate name is refused before any gate runs."""
    from qualification import qualify

    assert qualify.main(["--only", "readiness", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "qualify.json").read_text())
    verdicts = {g["gate"]: g["verdict"] for g in rep["gates"]}
    assert sum(v == "not run" for v in verdicts.values()) == len(qualify.GATES) - 1
    assert verdicts["8 readiness protocol"] == "pass"
    assert "NOT a qualification run" in rep["subset"]
    assert "NOT a qualification run" in (tmp_path / "qualify.md").read_text()
    with pytest.raises(SystemExit):
        qualify.main(["--only", "no_such_gate", "--out", str(tmp_path / "x")])
    assert "invalid choice" in capsys.readouterr().err
