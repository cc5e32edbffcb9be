"""Re-arming an engine's TP rings wherever a request may have left empty steps (kernels/
readiness.py, "Empty steps"): at each request's start — collective: every rank runs the same
request, and the previous one may have ended in rounds with 0 live rows — and after a CUDA-graph
capture, whose warm-up ran steps with 0 live rows (an eager prefill runs none). Shared by
iquestrt.tp.engine.TPEngine and the rank benchmark's RankEngine (benchmarks/rank/engine.py).
"""

from __future__ import annotations


class RingResets:
    """Mixin listed before Engine in an engine's bases; the engine says where its rings are."""

    def ring_set(self):
        """→ (TPRings | None, TPGroup | None): the rings the reductions go through, this rank's
        group."""
        raise NotImplementedError

    def generate(self, req, on_round=None, on_tokens=None):
        """As Engine.generate, after re-arming the rings (collective)."""
        self._reset_rings()
        return super().generate(req, on_round, on_tokens)

    def _prepare(self, st, hidden):
        launcher = super()._prepare(st, hidden)
        if self.rcfg.graphs:  # a capture's warm-up ran empty steps; eager prefill ran none
            self._reset_rings()
        return launcher

    def _reset_rings(self) -> None:
        rings, group = self.ring_set()
        if rings is not None:
            rings.reset(group)
