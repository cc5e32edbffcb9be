"""A negative control: a readable mutation of one piece, and the gate run that must catch it.

`run(mutated)` executes the mapped gate — on the unmutated piece when `mutated` is False (the
baseline, which must pass) and on the mutant when True — and returns (gate passed, evidence).
A control is caught when its baseline passes and its mutated run does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Control:
    name: str
    gate: str  # the gate of `nox -s qualify` that must catch it
    mutation: str  # what is broken, in one sentence
    run: Callable[[bool], tuple[bool, list[str]]]
