"""Paired experiments end to end on the tiny correlated checkpoint (CPU, twins): alternation
order and why it matters (a synthetic drifting clock: identical arms give a ratio interval
around 1 only when the order alternates), identical arms → exactly zero acceptance difference,
the replay check stopping an experiment, round-program signatures, the atomic record with its
warnings (busy machine, few pairs), and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from iquestrt.cli import main
from iquestrt.config import RuntimeConfig
from iquestrt.experiment.arms import ArmSpec
from iquestrt.experiment.engine import ExperimentEngine
from iquestrt.experiment.main import run_and_record
from iquestrt.experiment.record import write_record
from iquestrt.experiment.runner import Experiment, ExperimentError, Plan, PromptCase
from iquestrt.experiment.signature import ProgramSignature, compare
from iquestrt.experiment.summary import markdown, summarize
from reference.config import preset
from tests.experiment.conftest import PROMPTS
from tests.helpers.engine_setup import SAMPLING

BASE = RuntimeConfig(ops="twins", ring_pad=8, max_positions=64)
CASES = tuple(PromptCase(f"p{i}", p) for i, p in enumerate(PROMPTS))


class DriftClock:
    """Decode time grows by `drift` with every request, on every engine (a warming machine)."""

    def __init__(self, drift: float):
        self.t, self.k, self.running, self.drift = 0.0, 0, False, drift

    def __call__(self) -> float:
        if self.running:
            self.t += 1.0 + self.drift * self.k
            self.k += 1
        self.running = not self.running
        return self.t


class ForwardOnly(Plan):
    """Broken on purpose: the arms always run in the same order."""

    def order(self, i: int) -> tuple[int, ...]:
        return tuple(range(len(self.arms)))


def _plan(specs, plan_cls=Plan, seeds=(0, 1), n_new=8) -> Plan:
    arms = tuple(ArmSpec.parse(label, f"--{label}", s) for label, s in specs)
    rcfgs = tuple(a.runtime_config(BASE, preset("tiny")) for a in arms)
    return plan_cls(CASES, seeds, arms, rcfgs, n_new, SAMPLING)


def _engines(tiny_dir, plan, clock=None):
    engines = [ExperimentEngine.from_checkpoint(tiny_dir, r) for r in plan.rcfgs]
    if clock is not None:
        for e in engines:
            e.clock = clock
    return engines


@pytest.mark.slow
def test_alternation_cancels_drift_that_forward_order_shows(tiny_dir):
    specs = (("control", "depth=3"), ("candidate", "depth=3"))
    plan = _plan(specs)
    assert [plan.order(i) for i in range(4)] == [(0, 1), (1, 0), (0, 1), (1, 0)]
    assert _plan(specs + (("control′", "depth=3"),)).order(1) == (2, 1, 0)
    out = Experiment(plan, _engines(tiny_dir, plan, DriftClock(0.1)), log=lambda m: None).run()
    assert [(r.pair, r.slot, r.arm) for r in out.runs[:4]] == [
        (0, 0, "control"), (0, 1, "candidate"), (1, 0, "candidate"), (1, 1, "control")]
    s = summarize(out.runs, ["control", "candidate"], resamples=2000, seed=0, level=0.95)
    c = s["comparisons"][0]
    for key in ("tpot_ratio", "round_ratio"):
        assert c[key]["lo"] <= 1.0 <= c[key]["hi"], c[key]
    # every run emits 8 tokens, so per-token times cancel exactly over two consecutive pairs
    # (round counts differ between prompts: round latencies cancel only within the interval)
    assert abs(c["tpot_ratio"]["estimate"] - 1.0) < 1e-12, c["tpot_ratio"]
    assert (c["accepted_diff"]["estimate"], c["accepted_diff"]["lo"],
            c["accepted_diff"]["hi"]) == (0.0, 0.0, 0.0)
    assert c["identical_outputs"] == c["pairs"] == 4
    broken = _plan(specs, ForwardOnly)
    out = Experiment(broken, _engines(tiny_dir, broken, DriftClock(0.1)), lambda m: None).run()
    c = summarize(out.runs, ["control", "candidate"], resamples=2000, seed=0,
                  level=0.95)["comparisons"][0]
    assert c["tpot_ratio"]["lo"] > 1.0, c["tpot_ratio"]  # the later slot always looks slower
    assert c["accepted_diff"]["hi"] == 0.0  # acceptance is blind to the clock


@pytest.mark.slow
def test_a_replay_that_differs_stops_the_experiment(tiny_dir, monkeypatch):
    plan = _plan((("control", "depth=3"), ("candidate", "depth=2")))
    exp = Experiment(plan, _engines(tiny_dir, plan), log=lambda m: None)
    take = Experiment.snapshot

    def corrupted(self, arm, prompt):
        snap = take(self, arm, prompt)
        k = snap.k[0].clone()
        k[1, 0, 0] += 1.0
        return dataclasses.replace(snap, k=(k, *snap.k[1:]))

    monkeypatch.setattr(Experiment, "snapshot", corrupted)
    with pytest.raises(ExperimentError, match="replay from the prefill snapshot differs from real "
                                              r"prefill \(control, prompt p0, seed 0\)"):
        exp.run()


@pytest.mark.slow
def test_program_signatures(tiny_dir):
    plan = _plan((("control", "depth=3"), ("candidate", "depth=5"), ("control′", "depth=3")),
                 seeds=(0,))
    out = Experiment(plan, _engines(tiny_dir, plan), log=lambda m: None).run()
    a, b, a2 = (out.signatures[k] for k in ("control", "candidate", "control′"))
    assert a.digest == a2.digest and a.digest != b.digest
    assert len(b.calls) > len(a.calls)
    assert sum("ops.sample(" in c for c in a.calls) == 3 + 1  # 3 drafts + the target rows
    v = compare("cpu", a, b)
    assert v["graphs"].startswith("no graphs on this device (cpu)") and v["programs_differ"]
    assert not compare("cpu", a, a2)["programs_differ"]
    # the verdicts a CUDA device would give (signatures recorded during capture)
    cap = [ProgramSignature(True, s.calls) for s in (a, b, a2)]
    assert compare("cuda", cap[0], cap[1])["graphs"] == "captured launches differ"
    assert compare("cuda", cap[0], cap[2])["graphs"].startswith("IDENTICAL captured launches")
    assert compare("cuda", a, cap[1])["graphs"].startswith("only one arm captures a graph")
    assert compare("cuda", a, a2)["graphs"].startswith("graphs off in both arms")


@pytest.mark.slow
def test_record_is_complete_and_written_atomically(tiny_dir, tmp_path, monkeypatch):
    plan = _plan((("control", "depth=3"), ("candidate", "depth=2")), seeds=(0,))
    out = tmp_path / "exp"
    busy = 3.0 * (os.cpu_count() or 1) + 8  # far above the CPUs, own threads taken off or not
    monkeypatch.setattr(os, "getloadavg", lambda: (busy, busy, busy))
    rec = run_and_record(plan, _engines(tiny_dir, plan), out=out, checkpoint=tiny_dir,
                         command="iquestrt experiment …", resamples=500, boot_seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]
    assert json.loads((out / "record.json").read_text()) == rec
    md = (out / "record.md").read_text()
    assert rec["revision"]["commit"] in md and "## Raw runs" in md
    # 2 prompts × 1 seed = 2 pairs on a (patched) busy machine: both warnings, in both files
    assert [w.split(":")[0] for w in rec["warnings"]] == ["high machine load", "few pairs"]
    assert rec["warnings"][1].startswith("few pairs: 2 (prompt, seed) pairs, fewer than 10")
    assert rec["load"]["load_1m_start"] == rec["load"]["load_1m_end"] == busy
    assert rec["load"]["cpus"] == os.cpu_count()
    warned = md.split("## Warnings")[1].split("## Setup")[0]
    assert all(f"- **{w}**" in warned for w in rec["warnings"])
    unknown = {**rec, "revision": {"commit": "unknown", "worktree": "unknown", "dirty": []},
               "warnings": []}
    md_unknown = markdown(unknown)
    assert "- revision: `unknown` (not run from a git checkout)" in md_unknown
    assert "## Warnings\n\n- none\n" in md_unknown
    assert {"python", "torch", "triton", "device"} <= set(rec["environment"])
    assert len(rec["runs"]) == 2 * 2 and all(r["decode_s"] > 0 for r in rec["runs"])
    assert rec["log"][-1].startswith("pair 2/2 p1 seed 0: ")
    with pytest.raises(ValueError, match="already exists"):
        write_record(out, {"x": 1}, "x")
    with pytest.raises(ValueError, match="Out of range float values"):  # fails mid-write
        write_record(out, {"x": float("nan")}, "x", force=True)
    assert json.loads((out / "record.json").read_text()) == rec
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no temporary left behind
    write_record(out, {"x": 2}, "two", force=True)
    assert json.loads((out / "record.json").read_text()) == {"x": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


@pytest.mark.slow
def test_cli_experiment_with_aa_arm(tiny_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["experiment", "--checkpoint", str(tiny_dir), "--prompts", str(prompts_file),
               "--seeds", "0", "1", "--control", "depth=3", "--candidate", "depth=2", "--aa",
               "--max-new-tokens", "8", "--resamples", "500", "--out", str(out)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "replay check control p0 seed 0: bit-exact" in err and "pair 4/4" in err
    rec = json.loads((out / "record.json").read_text())
    assert [a["label"] for a in rec["plan"]["arms"]] == ["control", "candidate", "control′"]
    assert rec["command"].startswith("iquestrt experiment --checkpoint")
    assert all(c["tokens_equal"] and c["rounds_equal"] and c["caches_equal"]
               for c in rec["replay_checks"])
    aa = rec["summary"]["comparisons"][1]
    assert aa["arm"] == "control′" and aa["identical_outputs"] == 4
    assert (aa["accepted_diff"]["lo"], aa["accepted_diff"]["hi"]) == (0.0, 0.0)
    assert rec["program_check"]["control′ vs control"]["programs_differ"] is False
    assert rec["program_check"]["candidate vs control"]["programs_differ"] is True


@pytest.mark.slow
def test_snapshot_dir_saves_then_reuses(tiny_dir, tmp_path):
    plan = dataclasses.replace(_plan((("control", "depth=3"), ("candidate", "depth=2")),
                                     seeds=(0,)), snapshot_dir=tmp_path / "snaps")
    first, second = [], []
    Experiment(plan, _engines(tiny_dir, plan), log=first.append).run()
    assert len(list((tmp_path / "snaps").iterdir())) == len(CASES)
    out = Experiment(plan, _engines(tiny_dir, plan), log=second.append).run()
    assert sum(", saved " in m for m in first) == sum("loaded " in m for m in second) == 2
    assert all(c["tokens_equal"] and c["caches_equal"] for c in out.checks)
