"""qualify --jobs: gates in their own processes give the verdicts and evidence of the in-process
run; a crashed, hung or unknown gate process is a FAIL naming the cause, never a hang."""

import json

import pytest

from qualification import gate_pool, qualify
from qualification.gates import FAIL


def _gates(path):
    return {g["gate"]: g for g in json.loads(path.read_text())["gates"]}


@pytest.mark.slow
def test_gate_processes_equal_the_in_process_run(tmp_path, capsys):
    only = ["--only", "readiness", "bitexact_runtime"]
    assert qualify.main([*only, "--jobs", "1", "--out", str(tmp_path / "one")]) == 0
    assert qualify.main([*only, "--jobs", "2", "--out", str(tmp_path / "two")]) == 0
    out = capsys.readouterr().out
    assert "2 gates, 2 at a time, each in its own process" in out
    one, two = _gates(tmp_path / "one" / "qualify.json"), _gates(tmp_path / "two" / "qualify.json")
    assert one.keys() == two.keys()
    for name in one:
        assert (one[name]["verdict"], one[name]["margin"], one[name]["evidence"]) == (
            two[name]["verdict"], two[name]["margin"], two[name]["evidence"]), name
    assert two["8 readiness protocol"]["verdict"] == "pass"
    assert json.loads((tmp_path / "two" / "qualify.json").read_text())["gate processes"] == (
        "2 at a time")


def test_a_gate_past_its_timeout_is_killed_and_fails():
    lines = []
    res = gate_pool.run(["readiness"], [], jobs=1, timeout_s=0.5, say=lines.append)["readiness"]
    assert res.verdict == FAIL and "timed out after 0.5 s" in res.margin
    assert res.seconds < 30
    assert any("readiness: FAIL" in line for line in lines)


@pytest.mark.slow
def test_a_process_without_a_result_fails_with_its_output():
    res = gate_pool.run(["no_such_gate"], [], jobs=1, timeout_s=120, say=lambda _: None)
    r = res["no_such_gate"]
    assert r.verdict == FAIL and "exited with status 2 without a result" in r.margin
    assert any("name one gate of" in e for e in r.evidence)


@pytest.mark.parametrize("args, msg", [(["--jobs", "0"], "--jobs must be ≥ 1"),
                                       (["--gate-timeout", "0"], "--gate-timeout must be > 0")])
def test_bad_pool_options_are_refused(args, msg, capsys):
    with pytest.raises(SystemExit):
        qualify.parse(args)
    assert msg in capsys.readouterr().err


def _gate_processes() -> list[int]:
    from pathlib import Path

    pids = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if b"qualification.gate_child" in (p / "cmdline").read_bytes():
                pids.append(int(p.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_an_interrupt_takes_the_gate_processes_with_it():
    """Ctrl-C in qualify (here: raised from its progress output) kills the running gate
    processes — they run in their own sessions, so the terminal's SIGINT would not reach them."""
    import time

    def interrupt(_line):
        raise KeyboardInterrupt

    before = set(_gate_processes())
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):  # at readiness's result line (≈ 10 s in)
        gate_pool.run(["readiness", "lockstep"], [], jobs=2, timeout_s=600, say=interrupt)
    assert time.monotonic() - t0 < 60  # lockstep (≈ 2 min here) was not waited for
    deadline = time.monotonic() + 10
    while set(_gate_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_gate_processes()) - before
