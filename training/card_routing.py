"""Distinct experts per window of consecutive positions, for the model card (training/card.py).

Routing. The reference exposes no routing hook, so `recorded_routes` wraps the instance's MoE
call and re-derives the top-k ids with ops.route from the same router input the model uses
(x, or router_in when folded). Distinct experts for r rows: over every window of r consecutive
prompt positions, the size of the union of their top-k ids, averaged (pooled over prompts).

Dimension letters: R rows of one MoE call, T positions, K top-k, E experts.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from reference import ops
from reference.model import ReferenceModel

TARGET_PREFIX = "model.layers."


@contextmanager
def recorded_routes(model: ReferenceModel):
    """Yields {prefix: [ids [R, K] per MoE call]} filled while the block runs."""
    log: dict[str, list[torch.Tensor]] = {}
    inner = model._moe

    def moe(pre, x, top_k, router_in=None):
        src = x if router_in is None else router_in  # the router input ReferenceModel._moe uses
        _, ids = ops.route(src, model.p[pre + "mlp.router.weight"], top_k)
        log.setdefault(pre, []).append(ids)
        return inner(pre, x, top_k, router_in)

    model._moe = moe
    try:
        yield log
    finally:
        del model._moe  # back to the class method


def target_routes(model: ReferenceModel, prompt: list[int]) -> dict[int, torch.Tensor]:
    """{MoE layer: ids [T, K]} of the target over one prompt (one prefill)."""
    n = len(prompt)
    with recorded_routes(model) as log:
        model.target(torch.tensor(prompt), torch.arange(n), model.new_target_cache())
    return {int(pre[len(TARGET_PREFIX):].rstrip(".")): torch.cat(ids)
            for pre, ids in log.items() if pre.startswith(TARGET_PREFIX)}


def union_sizes(ids: torch.Tensor, n_experts: int, rows: int) -> list[tuple[int, int]]:
    """(Σ union size, windows) over windows of r = 1 … rows consecutive positions; ids [T, K]."""
    hit = torch.zeros(ids.shape[0], n_experts, dtype=torch.bool)  # [T, E]
    hit.scatter_(1, ids, True)
    acc, out = hit, []
    for r in range(1, rows + 1):
        if r > 1:
            acc = acc[:-1] | hit[r - 1 :]  # acc[t] = experts of positions t … t+r−1
        out.append((int(acc.sum()), acc.shape[0]))
    return out


def uniform_union(n_experts: int, top_k: int, r: int) -> float:
    """E[union size] when each of r rows picks top_k distinct experts uniformly, independently."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** r)
