"""Canonical tensor names and shapes of an IQuest-Q1 checkpoint (target and MTP draft).

Every loader, writer and model uses this table, so one checkpoint loads into the reference and
the runtime alike. Draft tensors live in `mtp/` on disk; in memory they carry the prefix `mtp.`.

Kinds:
  "block"  — a matrix (or stack of matrices, experts first) stored as E4M3 with 128x128 FP32
             inverse scales `<name>_scale_inv` in FP8 checkpoints, BF16 otherwise;
  "fp32"   — kept in FP32 in every format (routers);
  "plain"  — kept in BF16 in every format (embeddings, norms, sink keys, eh_proj, lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass

from reference.config import ModelConfig

BLOCK = "block"
FP32 = "fp32"
PLAIN = "plain"
DRAFT_PREFIX = "mtp."
SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = 128


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    kind: str  # BLOCK | FP32 | PLAIN

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Inverse-scale grid of a block tensor: ceil-div of the last two dims by 128."""
        *lead, rows, cols = self.shape
        return (*lead, -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))


def block_name_scale(name: str) -> str:
    """`…weight` -> `…weight_scale_inv`; fused experts `…fc` -> `…fc_scale_inv`."""
    return name + SCALE_SUFFIX


def _attention(p: str, cfg: ModelConfig) -> dict[str, ParamSpec]:
    t = cfg.target
    return {
        f"{p}attention_norm.weight": ParamSpec((t.hidden_size,), PLAIN),
        f"{p}self_attn.qkv_proj.weight": ParamSpec(
            (t.q_size + 2 * t.kv_size, t.hidden_size), BLOCK
        ),
        f"{p}self_attn.o_proj.weight": ParamSpec((t.hidden_size, t.q_size), BLOCK),
        f"{p}self_attn.q_norm.weight": ParamSpec((t.head_dim,), PLAIN),
        f"{p}self_attn.k_norm.weight": ParamSpec((t.head_dim,), PLAIN),
        f"{p}self_attn.sink_k": ParamSpec((t.num_key_value_heads, t.head_dim), PLAIN),
        f"{p}attn_out_norm.weight": ParamSpec((t.hidden_size,), PLAIN),
        f"{p}feed_forward_norm.weight": ParamSpec((t.hidden_size,), PLAIN),
    }


def _moe(p: str, hidden: int, experts: int, inter: int) -> dict[str, ParamSpec]:
    return {
        f"{p}mlp.router.weight": ParamSpec((experts, hidden), FP32),
        f"{p}mlp.experts.fc": ParamSpec((experts, 2 * inter, hidden), BLOCK),  # gate rows, then up
        f"{p}mlp.experts.proj": ParamSpec((experts, hidden, inter), BLOCK),
    }


def target_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    t = cfg.target
    h = t.hidden_size
    specs = {"model.embed_tokens.weight": ParamSpec((t.vocab_size, h), PLAIN)}
    for i in range(t.num_hidden_layers):
        p = f"model.layers.{i}."
        specs.update(_attention(p, cfg))
        if i == 0:
            specs[f"{p}ffn_out_norm.weight"] = ParamSpec((h,), PLAIN)
            specs[f"{p}mlp.gate_proj.weight"] = ParamSpec((t.intermediate_size, h), BLOCK)
            specs[f"{p}mlp.up_proj.weight"] = ParamSpec((t.intermediate_size, h), BLOCK)
            specs[f"{p}mlp.down_proj.weight"] = ParamSpec((h, t.intermediate_size), BLOCK)
        else:
            specs.update(_moe(p, h, t.num_experts, t.moe_intermediate_size))
    specs["model.norm.weight"] = ParamSpec((h,), PLAIN)
    specs["lm_head.weight"] = ParamSpec((t.vocab_size, h), BLOCK if t.quantize_lm_head else PLAIN)
    return specs


def draft_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Draft tensors with the in-memory prefix `mtp.` (on disk: `mtp/` files, no prefix)."""
    t, d = cfg.target, cfg.draft
    h = t.hidden_size
    p = DRAFT_PREFIX
    specs = {
        f"{p}embed_tokens.weight": ParamSpec((t.vocab_size, h), PLAIN),
        f"{p}enorm.weight": ParamSpec((h,), PLAIN),
        f"{p}hnorm.weight": ParamSpec((h,), PLAIN),
        f"{p}eh_proj.weight": ParamSpec((h, 2 * h), PLAIN),  # [e | h] input order
    }
    specs.update(_attention(f"{p}layer.", cfg))
    specs[f"{p}layer.ffn_out_norm.weight"] = ParamSpec((h,), PLAIN)
    specs.update(_moe(f"{p}layer.", h, d.num_experts, d.moe_intermediate_size))
    specs[f"{p}norm.weight"] = ParamSpec((h,), PLAIN)
    specs[f"{p}lm_head.weight"] = ParamSpec((t.vocab_size, h), PLAIN)
    return specs


def all_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    return {**target_specs(cfg), **draft_specs(cfg)}
