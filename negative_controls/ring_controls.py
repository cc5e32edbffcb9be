"""Ring mutants, caught by gate 4 (ring boundaries): the ring the runtime builds is too small, or
its window is off by one in either direction. The gate's expected windows always come from the
true window (16, counting the current token)."""

from __future__ import annotations

from negative_controls.control import Control
from qualification import ring_gate


def _ring(**mutant):
    def run(mutated: bool):
        g = ring_gate.RingGateConfig()
        return ring_gate.check_case(
            g.cases[0], g, ring_gate.gate_device(), **(mutant if mutated else {})
        )

    return run


CONTROLS = (
    Control(
        "ring_of_exactly_window",
        "4 ring boundaries",
        "the sliding ring holds `window` slots (no pad), so multi-row verification writes "
        "evict history an earlier row still needs",
        _ring(pad=0),
    ),
    Control(
        "window_plus_one",
        "4 ring boundaries",
        "the ring's window is one too wide (an inclusive-offset convention mixed up)",
        _ring(window=17, pad=7),
    ),
    Control(
        "window_minus_one",
        "4 ring boundaries",
        "the ring's window is one too narrow (the current token not counted)",
        _ring(window=15, pad=9),
    ),
)
