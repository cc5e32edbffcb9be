"""Readiness-ring mutant, caught by gate 8 (readiness protocol): consumer(t) re-arms the buffer
one step too early — the slot of step t − k + 1 instead of t − k — by patching
`RingPolicy.rearm_slot`, the slot function PartialRing and the protocol model both use. The
fields (B = 3, k = 1) are unchanged, so `RingPolicy.safe` still says safe; only the model check
of the schedule sees that the consumer now re-arms the very buffer its peers are still reading.
"""

from __future__ import annotations

from contextlib import contextmanager

from kernels.readiness import RingPolicy
from negative_controls.control import Control
from qualification import readiness_gate


def rearm_one_step_early(self: RingPolicy, step: int) -> int:
    return (step - self.lag + 1) % self.buffers


@contextmanager
def _patched_rearm():
    real = RingPolicy.rearm_slot
    RingPolicy.rearm_slot = rearm_one_step_early
    try:
        yield
    finally:
        RingPolicy.rearm_slot = real


def _gate(mutated: bool):
    if not mutated:
        return readiness_gate.run()
    with _patched_rearm():
        return readiness_gate.run()


CONTROLS = (
    Control(
        "nan_readiness_rearmed_too_early",
        "8 readiness protocol",
        "consumer(t) re-arms its partial buffer of step t − lag + 1 (one step too early), i.e. "
        "the buffer it and its peers read at step t",
        _gate,
    ),
)
