"""Checkpoint → per-layer weight structs on the device, kept in the checkpoint's own formats:
E4M3 block weights with their FP32 inverse scales (never dequantized), BF16 plain tensors (norms,
sink keys, embeddings, eh_proj, lm_head), FP32 routers; plus the RoPE tables of both bases.
Tensors already on the device in the right dtype are used as they are, not copied: on the CPU
the weights share storage with the Checkpoint's tensors.

Dimension letters: V vocabulary, H hidden, N output channels, K input columns, E experts,
I expert intermediate, F dense intermediate, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.qk_rope import RopeTable, rope_table
from reference.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from reference.config import FULL, ModelConfig
from reference.params import DRAFT_PREFIX, SCALE_SUFFIX

MAX_TOP_K = 16  # experts per token the tails' router and the MoE kernel handle


@dataclass(frozen=True)
class Fp8Linear:
    w: torch.Tensor  # [N, K] E4M3
    s: torch.Tensor  # [⌈N/128⌉, ⌈K/128⌉] FP32 inverse scales


@dataclass(frozen=True)
class AttnWeights:
    attention_norm: torch.Tensor  # [H] bf16
    qkv: Fp8Linear  # [(Hq + 2·Hkv)·D, H]
    o: Fp8Linear  # [H, Hq·D]
    q_norm: torch.Tensor  # [D] bf16
    k_norm: torch.Tensor  # [D] bf16
    sink_k: torch.Tensor  # [Hkv, D] bf16
    attn_out_norm: torch.Tensor  # [H] bf16
    ffn_norm: torch.Tensor  # [H] bf16 (feed_forward_norm)


@dataclass(frozen=True)
class MoeWeights:
    router: torch.Tensor  # [E, H] FP32
    fc: torch.Tensor  # [E, 2I, H] E4M3: gate rows, then up rows
    fc_s: torch.Tensor  # [E, ⌈2I/128⌉, ⌈H/128⌉] FP32
    proj: torch.Tensor  # [E, H, I] E4M3
    proj_s: torch.Tensor  # [E, ⌈H/128⌉, ⌈I/128⌉] FP32
    top_k: int


@dataclass(frozen=True)
class DenseWeights:
    gate: Fp8Linear  # [F, H]
    up: Fp8Linear  # [F, H]
    down: Fp8Linear  # [H, F]
    ffn_out_norm: torch.Tensor  # [H] bf16


@dataclass(frozen=True)
class TargetLayer:
    index: int
    window: int | None  # None: full attention
    rope: RopeTable
    attn: AttnWeights
    dense: DenseWeights | None  # layer 0
    moe: MoeWeights | None  # layers ≥ 1


@dataclass(frozen=True)
class DraftWeights:
    embed: torch.Tensor  # [V, H] bf16
    enorm: torch.Tensor  # [H]
    hnorm: torch.Tensor  # [H]
    eh_proj: torch.Tensor  # [H, 2H] bf16, embedding half first
    attn: AttnWeights
    ffn_out_norm: torch.Tensor  # [H]
    moe: MoeWeights  # its own router, BF16 input (not folded)
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] bf16
    window: int
    rope: RopeTable


@dataclass(frozen=True)
class Weights:
    cfg: ModelConfig
    device: torch.device
    max_positions: int  # RoPE table length: positions ≥ this give NaN q/k (kernels/qk_rope.py)
    embed: torch.Tensor  # [V, H] bf16
    layers: tuple[TargetLayer, ...]
    norm: torch.Tensor  # [H] final norm
    lm_head: torch.Tensor | Fp8Linear  # [V, H] bf16, or E4M3 when quantize_lm_head
    draft: DraftWeights


def _check_runtime_shapes(cfg: ModelConfig, where: str) -> None:
    """What the kernels need beyond the loader's checks."""
    t, d = cfg.target, cfg.draft
    problems = []
    if t.head_dim < 16 or t.head_dim & (t.head_dim - 1):
        problems.append(f"head_dim={t.head_dim} (attention kernel: a power of two >= 16)")
    for name, k in (("num_experts_per_tok", t.num_experts_per_tok),
                    ("draft num_experts_per_tok", d.num_experts_per_tok)):
        if k > MAX_TOP_K:
            problems.append(f"{name}={k} (router / MoE kernels: at most {MAX_TOP_K})")
    if not (t.qk_norm and t.attention_sink):
        problems.append("qk_norm and attention_sink must both be on (the runtime's only path)")
    if problems:
        raise CheckpointError(f"{where}: not servable by the runtime: " + "; ".join(problems))


class _Loader:
    def __init__(self, ckpt: Checkpoint, device: torch.device):
        self.t, self.dev = ckpt.tensors, device

    def plain(self, name: str) -> torch.Tensor:
        return self.t[name].to(self.dev, torch.bfloat16).contiguous()

    def fp32(self, name: str) -> torch.Tensor:
        return self.t[name].to(self.dev, torch.float32).contiguous()

    def native(self, name: str) -> torch.Tensor:
        return self.t[name].to(self.dev).contiguous()

    def fp8(self, name: str) -> Fp8Linear:
        return Fp8Linear(self.native(name), self.native(name + SCALE_SUFFIX))

    def attn(self, pre: str) -> AttnWeights:
        a = pre + "self_attn."
        return AttnWeights(
            self.plain(pre + "attention_norm.weight"), self.fp8(a + "qkv_proj.weight"),
            self.fp8(a + "o_proj.weight"), self.plain(a + "q_norm.weight"),
            self.plain(a + "k_norm.weight"), self.plain(a + "sink_k"),
            self.plain(pre + "attn_out_norm.weight"), self.plain(pre + "feed_forward_norm.weight"),
        )

    def moe(self, pre: str, top_k: int) -> MoeWeights:
        m = pre + "mlp."
        return MoeWeights(
            self.fp32(m + "router.weight"), self.native(m + "experts.fc"),
            self.native(m + "experts.fc" + SCALE_SUFFIX), self.native(m + "experts.proj"),
            self.native(m + "experts.proj" + SCALE_SUFFIX), top_k,
        )


def from_checkpoint(ckpt: Checkpoint, device, max_positions: int | None = None) -> Weights:
    """max_positions: RoPE table length (default: the model's max_position_embeddings)."""
    cfg, where = ckpt.cfg, str(ckpt.directory)
    if ckpt.fmt != "fp8":
        raise CheckpointError(
            f"{where}: format {ckpt.fmt!r}; the runtime serves E4M3 block weights only "
            "(convert with `iquestrt convert --quantize`)"
        )
    _check_runtime_shapes(cfg, where)
    t, d = cfg.target, cfg.draft
    cap = t.max_position_embeddings if max_positions is None else max_positions
    if not 1 <= cap <= t.max_position_embeddings:
        raise ValueError(
            f"max_positions: {cap} outside [1, max_position_embeddings={t.max_position_embeddings}]"
        )
    dev = torch.device(device)
    ld = _Loader(ckpt, dev)
    ropes: dict[tuple[float, int], RopeTable] = {}

    def rope(theta: float, offset: int = 0) -> RopeTable:
        if (theta, offset) not in ropes:
            ropes[theta, offset] = rope_table(cap, t.rotary_dim, theta, dev, offset)
        return ropes[theta, offset]

    layers = []
    for i, kind in enumerate(t.layer_types):
        pre = f"model.layers.{i}."
        full = kind == FULL
        dense = None
        if i == 0:
            m = pre + "mlp."
            dense = DenseWeights(
                ld.fp8(m + "gate_proj.weight"), ld.fp8(m + "up_proj.weight"),
                ld.fp8(m + "down_proj.weight"), ld.plain(pre + "ffn_out_norm.weight"),
            )
        layers.append(TargetLayer(
            i, None if full else t.sliding_window, rope(t.rope_theta if full else t.swa_rope_theta),
            ld.attn(pre), dense, None if i == 0 else ld.moe(pre, t.num_experts_per_tok),
        ))
    p = DRAFT_PREFIX
    draft = DraftWeights(
        ld.plain(p + "embed_tokens.weight"), ld.plain(p + "enorm.weight"),
        ld.plain(p + "hnorm.weight"), ld.plain(p + "eh_proj.weight"), ld.attn(p + "layer."),
        ld.plain(p + "layer.ffn_out_norm.weight"), ld.moe(p + "layer.", d.num_experts_per_tok),
        ld.plain(p + "norm.weight"), ld.plain(p + "lm_head.weight"), d.sliding_window,
        rope(d.swa_rope_theta, d.draft_position_offset),
    )
    lm_head = ld.fp8("lm_head.weight") if t.quantize_lm_head else ld.plain("lm_head.weight")
    return Weights(cfg, dev, cap, ld.plain("model.embed_tokens.weight"), tuple(layers),
                   ld.plain("model.norm.weight"), lm_head, draft)


def load_weights(directory: str | Path, device, max_positions: int | None = None) -> Weights:
    return from_checkpoint(load_checkpoint(directory), device, max_positions)
