"""Prefetch overriding routing (gate 3d): the prefetcher's predicted experts replace the router's
choice of the layer it ran for — a prefetch that "helps" routing instead of only warming caches.
On the twins engine the mutant computes the prediction with the predictor's exact twin."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from iquestrt.ops import KernelOps, TwinOps
from iquestrt.prefetch import Prefetcher
from negative_controls.control import Control, patched
from qualification import prefetch_gate
from reference.twins.prefetch import prefetch_experts_ref


@contextmanager
def prefetch_overrides_routing():
    pending: list[torch.Tensor] = []
    used: list[int] = []

    def maybe_prefetch(self, layer_index, xn, live):
        if layer_index in self.p:  # the prediction on the host (eager rounds: live.n may sync)
            ids = prefetch_experts_ref(xn.float().cpu(), live.n, self.p[layer_index].float().cpu(),
                                       self.m, self.cfg.min_rows, self.cfg.max_rows)
            if ids is not None:
                pending.append(ids)
        return None

    def overriding(real_tail):
        def attn_tail(self, parts, xn, aon, ffn, live, flag, **kw):
            out = real_tail(self, parts, xn, aon, ffn, live, flag, **kw)
            if pending and out.ids is not None:
                ids = pending.pop()
                k = out.ids.shape[1]
                out.ids[: live.n] = ids[:k].to(out.ids.device, out.ids.dtype)  # prediction wins
                used.append(1)
            return out
        return attn_tail

    # both op sets: the twins on the CPU, the kernels (with real prefetch launches) on a GPU
    with patched(Prefetcher, maybe_prefetch=maybe_prefetch), \
            patched(TwinOps, attn_tail=overriding(TwinOps.attn_tail)), \
            patched(KernelOps, attn_tail=overriding(KernelOps.attn_tail)):
        yield
    if not used:
        raise RuntimeError("prefetch_overrides_routing: the mutant never replaced a routing "
                           "decision (the prefetcher or the tails it patches were not reached)")


def _gate(mutated: bool) -> tuple[bool, list[str]]:
    if not mutated:
        ok, _, ev = prefetch_gate.run()
        return ok, ev
    with prefetch_overrides_routing():
        ok, _, ev = prefetch_gate.run()
    return ok, ev


CONTROLS = (
    Control(
        "prefetch_overrides_routing",
        "3d prefetch on vs off",
        "the expert prefetch's predicted experts replace the router's choice in the layer it ran "
        "for",
        _gate,
    ),
)
