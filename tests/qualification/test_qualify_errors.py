"""qualify keeps going when a gate crashes: that gate fails with the exception named, the
others still run, the report is written and the exit status is 1."""

import json

from qualification import qualify
from qualification.gates import PASS, GateResult


def test_a_crashing_gate_fails_and_the_others_still_run(monkeypatch, tmp_path, capsys):
    def gate_boom(q, models):
        raise RuntimeError("planted crash")

    def gate_fine(q, models):
        return GateResult("fine", PASS, "ok", ["ran"])

    monkeypatch.setattr(qualify, "GATES", (gate_boom, gate_fine))
    assert qualify.main(["--jobs", "1", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "[1/2] gate_boom" in out and "[2/2] gate_fine" in out, out
    rows = {r["gate"]: r for r in json.loads((tmp_path / "qualify.json").read_text())["gates"]}
    assert rows["boom"]["verdict"] == "FAIL" and "RuntimeError" in rows["boom"]["margin"]
    assert "planted crash" in rows["boom"]["evidence"][0]
    assert rows["fine"]["verdict"] == PASS
