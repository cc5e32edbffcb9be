"""End-to-end distribution control (gate 5b): the replacement after the first rejection drawn
from the target row p instead of norm(max(0, p − q)), inside the real decode loop of the mini
model. Gate 5 catches the same defect on Markov rounds; this one shows the end-to-end gate does.
The control runs N = 200 requests on the baseline and on the mutant (the mutant then gives
p ≈ 5e-6 against α = 1e-3; qualify's gate runs 400)."""

from __future__ import annotations

from negative_controls.control import Control
from qualification import distribution_e2e

N = 200


def _gate(mutated: bool) -> tuple[bool, list[str]]:
    mutate = distribution_e2e.replacement_from_p if mutated else None
    ok, _, evidence = distribution_e2e.run(distribution_e2e.E2EConfig(n=N, engine_check=0),
                                           report=None, mutate=mutate)
    return ok, evidence


CONTROLS = (
    Control(
        "replacement_from_p_end_to_end",
        "5b end-to-end first tokens",
        "in the decode loop, the token after the first rejection is drawn from p, not from "
        "norm(max(0, p − q))",
        _gate,
    ),
)
