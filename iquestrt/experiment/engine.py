"""The engine an experiment arm runs: snapshot replay (iquestrt/snapshot.py) plus a decode clock
and the round program's signature (iquestrt/experiment/signature.py).

Decode clock: `last_decode_s` is the wall time of Engine._loop — every round launched, the
result log read, the request's end settled — after prefill (restored or real), draft prefill,
the first token and the round program's setup or capture, which stay outside it. On a CUDA
device the clock reads sit between two torch.cuda.synchronize() calls, so queued work is counted
where it runs. `clock` is a plain attribute (tests put a synthetic clock there).
"""

from __future__ import annotations

import time

import torch

from iquestrt.experiment.signature import FirstRoundRecorder, ProgramSignature, recording
from iquestrt.snapshot import SnapshotEngine


class ExperimentEngine(SnapshotEngine):
    clock = staticmethod(time.perf_counter)
    last_decode_s: float | None = None
    record_next: bool = False  # record the next request's round program
    signature: ProgramSignature | None = None

    def _sync(self) -> None:
        if self.w.device.type == "cuda":
            torch.cuda.synchronize(self.w.device)

    def _loop(self, st, program, *args, **kwargs) -> None:
        self.last_decode_s = None
        self._sync()
        t0 = self.clock()
        super()._loop(st, program, *args, **kwargs)
        self._sync()
        self.last_decode_s = self.clock() - t0

    def _prepare(self, st, hidden):
        if not self.record_next:
            return super()._prepare(st, hidden)
        self.record_next = False
        if self.rcfg.graphs:
            log: list[str] = []
            with recording(self, log):
                program = super()._prepare(st, hidden)
            self.signature = ProgramSignature(True, tuple(log))
            return program

        def done(sig: ProgramSignature) -> None:
            self.signature = sig

        launcher = super()._prepare(st, hidden)  # eager: one_round is the round program
        launcher.one_round = FirstRoundRecorder(self, launcher.one_round, done)
        return launcher
