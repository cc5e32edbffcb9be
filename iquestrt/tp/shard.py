"""One tensor-parallel rank's target weights, cut from the full runtime Weights by the padded
block-FP8 plan (iquestrt/tp/plan.py): its query heads and KV heads (QKV rows, sink keys, O
projection columns), its channels of every expert and of the dense layer 0 (gate / up rows as
paired halves, down / proj columns), its vocabulary rows of an E4M3 lm_head (a BF16 one is sliced
plainly); router, norms and embeddings replicated. The draft is not cut: every rank holds it whole.

The rank's ModelConfig has the rank's head counts, so caches, qk-norm/RoPE and attention run
unchanged on `num_key_value_heads / N` heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from iquestrt.tp.plan import DimPlan, Run, padded, paired, rank_runs, shard_cols, shard_rows
from iquestrt.weights import DenseWeights, Fp8Linear, MoeWeights, Weights
from reference.config import ModelConfig


@dataclass(frozen=True)
class RankPlans:
    """The plans a rank's forward reads activations through (the weights already follow them)."""

    tp: int
    rank: int
    qkv: DimPlan  # QKV output channels: q run, k run, v run
    o_in: DimPlan  # O projection input: the rank's q-head channels
    vocab: DimPlan  # lm_head rows (E4M3 lm_head), or the plain slice's one run


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    rs = cfg.per_rank(tp)
    return dataclasses.replace(cfg, target=dataclasses.replace(
        cfg.target, num_attention_heads=rs.q_heads, num_key_value_heads=rs.kv_heads))


def _rows(lin: Fp8Linear, plan: DimPlan) -> Fp8Linear:
    return Fp8Linear(*shard_rows(lin.w, lin.s, plan))


def _cols(lin: Fp8Linear, plan: DimPlan) -> Fp8Linear:
    return Fp8Linear(*shard_cols(lin.w, lin.s, plan))


def shard_weights(w: Weights, tp: int, rank: int) -> tuple[Weights, RankPlans]:
    cfg = w.cfg
    rs = cfg.per_rank(tp)
    qkv = padded(rank_runs(cfg, tp, rank, "qkv"))
    o_in = padded(rank_runs(cfg, tp, rank, "o_in"))
    e_fc, e_in = paired(rank_runs(cfg, tp, rank, "expert_fc")), padded(
        rank_runs(cfg, tp, rank, "expert"))
    d_in = padded(rank_runs(cfg, tp, rank, "dense"))
    kv = slice(rank * rs.kv_heads, (rank + 1) * rs.kv_heads)
    layers = []
    for layer in w.layers:
        a = layer.attn
        attn = dataclasses.replace(a, qkv=_rows(a.qkv, qkv), o=_cols(a.o, o_in),
                                   sink_k=a.sink_k[kv].contiguous())
        dense = moe = None
        if layer.dense is not None:
            d = layer.dense
            dense = DenseWeights(_rows(d.gate, d_in), _rows(d.up, d_in), _cols(d.down, d_in),
                                 d.ffn_out_norm)
        if layer.moe is not None:
            m = layer.moe
            fc, fc_s = shard_rows(m.fc, m.fc_s, e_fc)
            proj, proj_s = shard_cols(m.proj, m.proj_s, e_in)
            moe = MoeWeights(m.router, fc, fc_s, proj, proj_s, m.top_k)
        layers.append(dataclasses.replace(layer, attn=attn, dense=dense, moe=moe))
    vocab_runs = rank_runs(cfg, tp, rank, "vocab")
    if isinstance(w.lm_head, Fp8Linear):
        vocab = padded(vocab_runs)
        lm_head = _rows(w.lm_head, vocab)
    else:
        run = vocab_runs[0]
        vocab = DimPlan((Run(run.start, run.stop, 0),), len(run))  # BF16: no blocks
        lm_head = w.lm_head[run.start : run.stop].contiguous()
    rank_w = dataclasses.replace(w, cfg=rank_config(cfg, tp), layers=tuple(layers),
                                 lm_head=lm_head)
    return rank_w, RankPlans(tp, rank, qkv, o_in, vocab)
