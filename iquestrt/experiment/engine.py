"""The engine an experiment arm runs: snapshot replay (iquestrt/snapshot.py) plus a decode clock
and the round program's signature (iquestrt/experiment/signature.py).

Decode clock: `last_decode_s` is the wall time of the engine's decode loop — every round
launched, the result log read, the request's end settled — after prefill (restored or real),
draft prefill, the first token and the round program's setup or capture, which stay outside it.
On a CUDA device the clock reads sit between two torch.cuda.synchronize() calls, so queued work
is counted where it runs. `clock` is a plain attribute (tests put a synthetic clock there).
"""

from __future__ import annotations

import time

import torch

from iquestrt.engine_parts import EngineObserver, EngineParts
from iquestrt.experiment.signature import FirstRoundRecorder, ProgramSignature, recording
from iquestrt.snapshot import SnapshotEngine


class ExperimentEngine(SnapshotEngine):
    """A SnapshotEngine with the decode clock and the program recorder as its observer."""

    clock = staticmethod(time.perf_counter)
    last_decode_s: float | None = None
    record_next: bool = False  # record the next request's round program
    signature: ProgramSignature | None = None

    def __init__(self, weights, rcfg, prefetcher=None):
        parts = EngineParts.default(weights, rcfg, prefetcher)
        super().__init__(weights, rcfg, parts=parts.with_observers(ArmObserver(self)))


class ArmObserver(EngineObserver):
    """Times the decode loop and records the round program into the ExperimentEngine that
    owns it (its last_decode_s and signature)."""

    def __init__(self, owner: ExperimentEngine):
        self.owner = owner

    def _sync(self) -> None:
        if self.owner.w.device.type == "cuda":
            torch.cuda.synchronize(self.owner.w.device)

    def loop(self, eng, st, run) -> None:
        o = self.owner
        o.last_decode_s = None
        self._sync()
        t0 = o.clock()
        run()
        self._sync()
        o.last_decode_s = o.clock() - t0

    def prepare(self, eng, st, run):
        o = self.owner
        if not o.record_next:
            return run()
        o.record_next = False
        if eng.rcfg.graphs:
            log: list[str] = []
            with recording(eng, log):
                program = run()
            o.signature = ProgramSignature(True, tuple(log))
            return program

        def done(sig: ProgramSignature) -> None:
            o.signature = sig

        launcher = run()  # eager: one_round is the round program
        launcher.one_round = FirstRoundRecorder(eng, launcher.one_round, done)
        return launcher
