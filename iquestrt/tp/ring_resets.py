"""Re-arming an engine's TP rings wherever a request may have left empty steps (kernels/
readiness.py, "Empty steps"): at each request's start — collective: every rank runs the same
request, and the previous one may have ended in rounds with 0 live rows — and after a CUDA-graph
capture, whose warm-up ran steps with 0 live rows (an eager prefill runs none). An observer of
the engine's phases (iquestrt/engine_parts.py), given to iquestrt.tp.engine.TPEngine and the
rank benchmark's RankEngine (benchmarks/rank/engine.py).
"""

from __future__ import annotations

from iquestrt.engine_parts import EngineObserver


class RingResets(EngineObserver):
    """rings: the TPRings the reductions go through (None: nothing to re-arm); group: this
    rank's TPGroup (the reset is collective through it)."""

    def __init__(self, rings, group):
        self.rings, self.group = rings, group

    def request(self, eng, run):
        self.reset()
        return run()

    def prepare(self, eng, st, run):
        launcher = run()
        if eng.rcfg.graphs:  # a capture's warm-up ran empty steps; eager prefill ran none
            self.reset()
        return launcher

    def reset(self) -> None:
        if self.rings is not None:
            self.rings.reset(self.group)
