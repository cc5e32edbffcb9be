"""`bench round --tp N` (torchrun, N ≤ 8 GPUs of one host): the TP8 rank round with its target
reductions through a real ring (iquestrt/tp/peer_ring.py) over N processes. A TP8 rank's weights
fill one H200 (≈ 41 GB), and a TP-N rank of the whole model (N < 8) does not fit, so every
process holds the same TP8 rank and the ring has N real ranks plus 8 − N emulated ones (zero
partials in allocations of their own): at N = 8 this is the deployment's round; below, the
cross-GPU part of each reduction is real for N − 1 peers and the rest is local traffic.

Every process builds the same random weights (same seed) and runs the same requests, so all ranks
draw the same tokens and take the same reductions in the same order — the rings' step counters
agree without any exchange. Not exchanged: the sharded sampler's candidate all-gather (one per
target verification and per draft depth), the draft's reductions and layer 0's dense all-gather;
the record says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from benchmarks.rank.shapes import TP
from iquestrt.tp.group import TPGroup, all_gather
from iquestrt.tp.model import reduction_steps
from iquestrt.tp.peer_ring import TPRings, make_rings
from iquestrt.weights import Weights
from kernels.linear import linear_fp8_splits

NOT_EXCHANGED = ("sampler candidate all-gather (target and each draft depth)",
                 "draft reductions", "layer 0 dense all-gather")


@dataclass(frozen=True)
class TPBench:
    group: TPGroup
    rings: TPRings
    emulated: int  # ranks of TP8 with no process

    def record(self, results: list[dict]) -> dict:
        """Collective: every rank's round time of each configuration (NaN where it failed)."""
        mine = torch.tensor([r.get("round_s", math.nan) for r in results], dtype=torch.float64,
                            device=self.group.device)  # [C]
        every = all_gather(self.group, mine, "bench round --tp", "round times").cpu()  # [N, C]
        return {"world": self.group.world, "backend": self.group.backend,
                "emulated": self.emulated, "ring_slots": {"o": self.rings.o.policy.buffers,
                                                          "moe": self.rings.moe.policy.buffers},
                "rank_round_s": every.tolist(), "not_exchanged": list(NOT_EXCHANGED)}


def tp_bench(group: TPGroup, weights: Weights, rows: int, max_polls: int) -> TPBench:
    """The rings every engine of this rank shares (collective: every rank calls it)."""
    if not 2 <= group.world <= TP:
        raise ValueError(f"bench round --tp: {group.world} ranks; the TP{TP} rank's ring takes "
                         f"2..{TP}")
    o_w = weights.layers[0].attn.o.w  # [H, Po]: every layer's O projection
    emulated = TP - group.world
    rings = make_rings(group, rows, weights.cfg.target.hidden_size, linear_fp8_splits(*o_w.shape),
                       max_polls, *reduction_steps(weights), emulated=emulated)
    return TPBench(group, rings, emulated)
