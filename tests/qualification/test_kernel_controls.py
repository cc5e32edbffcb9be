"""negative_controls/kernel_controls.py without running the gate (each control runs the lockstep
gate twice in fresh processes, ~1 min each under the interpreter: `nox -s negative_controls`
runs them): every mutation names one line that occurs exactly once in its kernel file and
changes it; a line that is not there is refused before any process starts."""

from pathlib import Path

import pytest

from negative_controls import kernel_controls as kc

KERNELS = Path(kc.REPO) / "kernels"


def test_every_mutation_is_one_existing_line_of_a_kernel_file():
    assert len(kc.MUTATIONS) >= 10
    assert len({m.name for m in kc.MUTATIONS}) == len(kc.MUTATIONS)
    assert len({m.file for m in kc.MUTATIONS}) >= 8  # spread over the kernel families
    for m in kc.MUTATIONS:
        text = (KERNELS / m.file).read_text()
        assert text.count(m.old + "\n") == 1, (m.name, m.file)
        assert m.new != m.old and "\n" not in m.new and m.mutation
    assert {c.gate for c in kc.CONTROLS} == {"1b lockstep kernels vs twins"}


def test_a_line_that_is_not_in_the_kernel_is_refused():
    bad = kc.KernelMutation("gone", "fp8.py", "    x = no_such_line()", "    x = 1", "none")
    with pytest.raises(ValueError, match=r"occurs 0 times in kernels/fp8.py"):
        kc._run_gate(bad)


def test_prepared_runs_start_ahead_and_unprepared_ones_on_demand(monkeypatch):
    """prepare() starts the baseline and the named mutations in a pool; get() returns each
    prepared run's output once, and runs one that was not prepared when it is asked for."""
    seen = []

    def fake(m):
        seen.append(None if m is None else m.name)
        return {"name": None if m is None else m.name}

    monkeypatch.setattr(kc, "_run_gate", fake)
    runs = kc._Runs()
    first, second, third = kc.MUTATIONS[:3]
    runs.prepare([first.name, second.name, "not_a_kernel_control"], jobs=2)
    assert runs.get(first) == {"name": first.name} and runs.get(None) == {"name": None}
    assert sorted(seen, key=str) == sorted([None, first.name, second.name], key=str)
    assert runs.get(third) == {"name": third.name} and seen[-1] == third.name
    runs.pool.shutdown()
    serial = kc._Runs()
    serial.prepare([first.name, second.name], jobs=1)  # one at a time: nothing ahead
    assert serial.futures == {}
