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
The all-gather of partials stands in for the fused all-reduce over peer buffers (issue 8's GPU
part); its sums are the tails' own, so the readiness protocol sees the same parts.

Against the single-rank model the sums run in another order (partials per rank) and activation
quantization sees the rank's channels in their own 128-groups: results agree within the
stability band, not bit for bit (tests/tp/test_tp_model.py).

Dimension letters: R rows, S split-K partials, N ranks, H hidden, P padded channels, V vocab.
"""

from __future__ import annotations

import torch

from iquestrt.model import TargetModel, lm_head
from iquestrt.ops import Live
from iquestrt.tp.group import TPGroup, all_gather
from iquestrt.tp.shard import RankPlans
from iquestrt.weights import Weights

WHERE = "tp.model"


class TPTargetModel(TargetModel):
    def __init__(self, weights: Weights, plans: RankPlans, ops, width: int, group: TPGroup):
        super().__init__(weights, ops, width)
        if (group.world, group.rank) != (plans.tp, plans.rank):
            raise ValueError(f"TPTargetModel: weights of rank {plans.rank} of {plans.tp}, group "
                             f"rank {group.rank} of {group.world}")
        self.plans, self.group = plans, group

    def _gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """Partials [S, R, H] (or one [R, H]) → every rank's, [N·S, R, H] rank-major."""
        x = x if x.dim() == 3 else x[None]
        return all_gather(self.group, x, WHERE, what).reshape(-1, *x.shape[1:])

    def _attention(self, aw, xn, pos, live: Live, cache, table) -> torch.Tensor:
        """xn [R, H] → this rank's O partials [S, R, H]."""
        ops, t, pl = self.ops, self.t, self.plans
        parts = ops.linear_fp8_partials(xn, aw.qkv, live)  # [S, R, Pqkv]
        parts = pl.qkv.gather(parts).contiguous()  # [S, R, (q + 2·kv)·D]
        q, k, v = ops.qk_rope(parts, aw.q_norm, aw.k_norm, pos, table, live,
                              num_q_heads=t.num_attention_heads,
                              num_kv_heads=t.num_key_value_heads, eps=t.rms_norm_eps)
        ops.write_kv(cache, k, v, pos, live)
        o = ops.attention(q, cache, pos, live, aw.sink_k, t.head_dim**-0.5)  # [R, q, D]
        o = pl.o_in.scatter(o.reshape(o.shape[0], t.q_size))  # [R, Po]
        return ops.linear_fp8_partials(o, aw.o, live)  # [S, R, H]

    def forward_rows(self, tokens: torch.Tensor, pos: torch.Tensor, live: Live, caches,
                     flags: torch.Tensor):
        """As TargetModel.forward_rows → (this rank's logits [R, V/N] FP32, xn [R, H])."""
        w, ops, t = self.w, self.ops, self.t
        eps = t.rms_norm_eps
        x = w.embed[tokens]  # [R, H] bf16
        _, xn = ops.norm_rows(x, w.layers[0].attn.attention_norm, live, eps)
        last = len(w.layers) - 1
        for layer in w.layers:
            i, aw = layer.index, layer.attn
            o_parts = self._gather(self._attention(aw, xn, pos, live, caches.target[i],
                                                   layer.rope), f"layer {i} O partials")
            next_norm = w.norm if i == last else w.layers[i + 1].attn.attention_norm
            if layer.dense is not None:
                tail = ops.attn_tail(o_parts, x, aw.attn_out_norm, aw.ffn_norm, live,
                                     flags[i : i + 1], eps=eps, attn_out_scale=1.0)
                x, xn = self._dense_tp(layer.dense, tail.h, tail.f_in, live, next_norm)
                continue
            tail = ops.attn_tail(o_parts, xn, aw.attn_out_norm, aw.ffn_norm, live,
                                 flags[i : i + 1], eps=eps, attn_out_scale=t.attn_out_scale,
                                 router_w=layer.moe.router, top_k=layer.moe.top_k)
            if self.route_trace is not None:
                self.route_trace.append((i, tail.ids[: live.known].long().cpu()))
            f = ops.moe(tail.f_in, tail.weights, tail.ids, layer.moe, live, torch.float32)
            f_parts = self._gather(f, f"layer {i} MoE partials")  # [N, R, H]
            xn = ops.moe_tail(f_parts, tail.h, next_norm, live, flags[i : i + 1], eps=eps,
                              ffn_out_scale=t.ffn_out_scale).xn
        logits = lm_head(ops, w.lm_head, xn, live)  # [R, Pv]
        return self.plans.vocab.gather(logits).contiguous(), xn

    def _dense_tp(self, dw, h, f_in, live: Live, next_norm):
        ops, eps = self.ops, self.t.rms_norm_eps
        g = ops.linear_fp8(f_in, dw.gate, live, torch.bfloat16)  # [R, Pf]
        u = ops.linear_fp8(f_in, dw.up, live, torch.bfloat16)
        act = ops.silu_mul_rows(g, u, live)
        f = ops.linear_fp8(act, dw.down, live, torch.float32)  # [R, H] this rank's channels
        parts = all_gather(self.group, f, WHERE, "layer 0 dense partials")  # [N, R, H]
        total = parts[0]
        for p in parts[1:]:
            total = total + p  # rank order, FP32
        return ops.norm_rows(h, next_norm, live, eps, b=total.to(torch.bfloat16),
                             wb=dw.ffn_out_norm, sum_dtype=torch.bfloat16, store_sum=True)
