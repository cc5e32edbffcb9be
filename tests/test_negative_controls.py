"""The negative-control harness: controls are caught; a control that breaks nothing is reported
as not caught and fails the run."""

from negative_controls import run as nc
from negative_controls.control import Control


def test_selected_controls_are_caught(capsys):
    assert nc.main(["--only", "window_plus_one", "sink_dropped", "ratio_inverted"]) == 0
    out = capsys.readouterr().out
    assert "3 of 3 controls caught" in out


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


def test_there_are_at_least_twelve_controls_each_mapped_to_a_gate():
    names = [c.name for c in nc.ALL]
    assert len(names) == len(set(names)) >= 12
    assert all(c.gate[0].isdigit() and c.mutation for c in nc.ALL)
