"""The target model on one tensor-parallel rank (iquestrt/tp/shard.py's weights): the layer
order of iquestrt.model.TargetModel with the rank's heads and channels, and two all-gathers per
layer where the single-rank model has one device.

  attention: QKV partials [S, R, P] in the padded layout → the q/k/v runs gathered (plan.qkv) →
    qk-norm/RoPE, KV write and attention on the rank's heads → output [R, q·D] scattered into
    the O projection's padded input (plan.o_in) → O partials [S, R, H] →
    all-gather → [N·S, R, H]: the attention tail sums every rank's partials in rank order, so
    each rank computes the same h, f_in, routing (router replicated) and xn bit for bit;
  MoE: the rank's expert channels → partial [R, H] FP32 → all-gather [N, R, H] → the MoE tail's
    sum (rank order);
  dense layer 0: the rank's channels, down projection in FP32 → all-gather → summed in rank
    order → rounded to BF16 as the single-rank path rounds its down projection;
  lm_head: the rank's vocabulary rows → logits [R, V/N] (plan.vocab's runs).
With `rings` (RuntimeConfig.tp_reduce = "peer") there is no all-gather for O and MoE partials:
each rank writes its partials into its slot of a ring and the tails read every rank's slot
directly (iquestrt/tp/peer_ring.py), summing the same partials in the same order — the same
bits as the all-gather. Layer 0's dense down projection stays an all-gather.

Against the single-rank model the sums run in another order (partials per rank) and activation
quantization sees the rank's channels in their own 128-groups: results agree within the
stability band, not bit for bit (tests/tp/test_tp_model.py).

Dimension letters: R rows, S split-K partials, N ranks, H hidden, P padded channels, V vocab.
"""

from __future__ import annotations

import torch

from iquestrt.model import TargetModel, attention_block
from iquestrt.ops import Live
from iquestrt.tp.group import TPGroup, all_gather
from iquestrt.tp.peer_ring import TPRings
from iquestrt.tp.shard import RankPlans
from iquestrt.weights import Weights

WHERE = "tp.model"


def reduction_steps(weights: Weights) -> tuple[int, int]:
    """(O-projection reductions, expert reductions) of one target forward: every layer's
    attention, every MoE layer's experts — what each ring takes per forward."""
    return len(weights.layers), sum(layer.moe is not None for layer in weights.layers)


class TPTargetModel(TargetModel):
    def __init__(self, weights: Weights, plans: RankPlans, ops, width: int, group: TPGroup,
                 rings: TPRings | None = None):
        super().__init__(weights, ops, width)
        if (group.world, group.rank) != (plans.tp, plans.rank):
            raise ValueError(f"TPTargetModel: weights of rank {plans.rank} of {plans.tp}, group "
                             f"rank {group.rank} of {group.world}")
        self.plans, self.group, self.rings = plans, group, rings

    def _gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """Partials [S, R, H] (or one [R, H]) → every rank's, [N·S, R, H] rank-major."""
        x = x if x.dim() == 3 else x[None]
        return all_gather(self.group, x, WHERE, what).reshape(-1, *x.shape[1:])

    def _o_partials(self, layer, xn, pos, live: Live, cache, xq=None) -> torch.Tensor:
        """xn [R, H] (xq: its quantization, or None) → every rank's O partials [N·S, R, H]
        (this rank's heads), or with rings their RingRead."""
        ops, t, pl = self.ops, self.t, self.plans
        o, _ = attention_block(ops, t, layer.attn, xn, pos, live, cache, layer.rope,
                               qkv_view=pl.qkv.gather, xq=xq)  # [R, q·D] this rank's heads
        o = pl.o_in.scatter(o)  # [R, Po]
        if self.rings is not None:  # the GEMM writes this rank's ring slot
            ops.linear_fp8_partials(o, layer.attn.o, live, out=self.rings.next_o())
            return self.rings.read_o()
        mine = ops.linear_fp8_partials(o, layer.attn.o, live)  # [S, R, H]
        return self._gather(mine, f"layer {layer.index} O partials")

    def _expert_partials(self, layer, tail, live: Live, out=None):
        if self.rings is not None:  # the experts write this rank's ring slot
            super()._expert_partials(layer, tail, live, out=self.rings.next_moe()[0])
            return self.rings.read_moe()
        f = super()._expert_partials(layer, tail, live)  # [1, R, H]
        return self._gather(f, f"layer {layer.index} MoE partials")  # [N, R, H]

    def _down(self, act, down, live: Live) -> torch.Tensor:
        """This rank's channels in FP32, every rank's summed in rank order, then BF16 (as the
        one-rank down projection rounds its output)."""
        f = self.ops.linear_fp8(act, down, live, torch.float32)  # [R, H]
        parts = all_gather(self.group, f, WHERE, "layer 0 dense partials")  # [N, R, H]
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total.to(torch.bfloat16)

    def _logits(self, xn, live: Live) -> torch.Tensor:
        """This rank's vocabulary slice [R, V/N] (plan.vocab's runs of the padded rows)."""
        return self.plans.vocab.gather(super()._logits(xn, live)).contiguous()
