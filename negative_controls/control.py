"""A negative control: a readable mutation of one piece, and the gate run that must catch it.

`run(mutated)` executes the mapped gate — on the unmutated piece when `mutated` is False (the
baseline, which must pass) and on the mutant when True — and returns (gate passed, evidence).
A control is caught when its baseline passes and its mutated run does not.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Control:
    name: str
    gate: str  # the gate of `nox -s qualify` that must catch it
    mutation: str  # what is broken, in one sentence
    run: Callable[[bool], tuple[bool, list[str]]]


@contextmanager
def patched(owner, **attrs):
    """owner's attributes replaced by attrs inside the block, restored on exit (also when the
    block raises)."""
    real = {name: getattr(owner, name) for name in attrs}
    for name, fn in attrs.items():
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(owner, name, fn)


def gated(run, mutant, baseline=None) -> Callable[[bool], tuple[bool, list[str]]]:
    """A Control's run: the gate `run()` → (ok, margin, evidence) inside `mutant()`, and unmutated
    `baseline()` — `run` itself unless given: a gate run that holds `run`'s as an independent part
    (it passes only if `run` passes). Its `baseline` attribute is that function: controls with
    the same one share one unmutated run (negative_controls/run.py runs it once)."""
    baseline = baseline or run

    def gate(mutated: bool):
        if not mutated:
            ok, _, ev = baseline()
            return ok, ev
        with mutant():
            ok, _, ev = run()
        return ok, ev

    gate.baseline = baseline
    return gate
