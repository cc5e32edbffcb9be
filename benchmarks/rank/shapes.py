"""The model one tensor-parallel rank serves, written as an ordinary ModelConfig so that the
engine, the weights structs and the caches need no TP awareness: 6 query heads / 1 KV head,
dense layer 0 with intermediate 12288/8 = 1536, 256 experts × 192 channels (1.5 FP8 blocks:
kernels/moe.py handles the straddling scale block), a 20000-row vocabulary shard for both
embeddings and both lm_heads, 88 layers in the real pattern, and the draft's slice (same
attention slice, 256 × 192 experts, window 512).

What a rank config cannot express (the benchmark emulates or states it): the cross-rank sums
after o_proj and the experts (benchmarks/rank/ops.py reads 7 peer partial buffers), the vocab
shards of the other ranks (embedding all-reduce and the sampler's cross-rank top-k merge are
not emulated: a few KB per round).

`small_rank_config` keeps the structure (6:1 heads, I = 192, the layer pattern, 256/24-style
expert groups) at CPU-test size.
"""

from __future__ import annotations

import dataclasses

from reference.config import ConfigError, DraftConfig, ModelConfig, TargetConfig, layer_pattern
from reference.config import preset as model_preset

TP = 8  # IQuest-Q1's recommended serving: 8×H200, TP8


def rank_config(full: ModelConfig | None = None, tp: int = TP) -> ModelConfig:
    """One TP rank of `full` (default: the iquest-q1 preset) as a ModelConfig."""
    full = full or model_preset("iquest-q1")
    rs = full.per_rank(tp)  # checks divisibility with messages
    d = full.draft
    if d.moe_intermediate_size % tp:
        raise ConfigError(f"tp: draft moe_intermediate_size={d.moe_intermediate_size} is not "
                          f"divisible by tp={tp}")
    t = dataclasses.replace(
        full.target, vocab_size=rs.vocab, num_attention_heads=rs.q_heads,
        num_key_value_heads=rs.kv_heads, intermediate_size=rs.dense_intermediate,
        moe_intermediate_size=rs.expert_intermediate)
    draft = dataclasses.replace(d, moe_intermediate_size=d.moe_intermediate_size // tp)
    return ModelConfig(target=t, draft=draft, sampling=full.sampling,
                       name=f"{full.name}-tp{tp}-rank")


def small_rank_config(experts: int = 48, top_k: int = 8, repeats: int = 1) -> ModelConfig:
    """CPU-test size with a rank's structure: 6 query heads / 1 KV head, expert intermediate
    192 (1.5 FP8 blocks), hidden 256 (2 blocks), `[F] + [F,S,S,S]·repeats + [F,F,F]` layers.
    The default 48 experts × top-8 leave room for the mini model's 24 experts → groups of 2."""
    t = TargetConfig(
        vocab_size=640, hidden_size=256, layer_types=layer_pattern(repeats),
        num_attention_heads=6, num_key_value_heads=1, head_dim=32, rotary_dim=8,
        sliding_window=32, intermediate_size=192, num_experts=experts,
        num_experts_per_tok=top_k, moe_intermediate_size=192, max_position_embeddings=4096)
    d = DraftConfig(sliding_window=16, num_experts=experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=192)
    return ModelConfig(target=t, draft=d, name="small-rank")
