"""The memory floor of one speculative round on one rank: the bytes the round
must read from HBM ÷ the copy bandwidth measured in the same run. A pure function of the rank
config, the round's shape and the routing actually seen; no device work.

Terms (bytes; E4M3 weights count 1 byte per value plus their FP32 128×128 block scales):
  attention     QKV + o_proj of every target layer
  dense         layer 0's gate, up, down
  experts       Σ over MoE layers of the distinct experts the live rows routed to (gate/up/down)
  routers       FP32 [E, H] of every MoE layer (read by the folded router every round)
  kv            K and V (BF16) in range: a full layer reads positions 0 … m+D (context + rows),
                a sliding layer the union of its rows' windows (window + rows − 1, capped by
                context + rows)
  lm_head       the target's shard (rows × … is free: one read of [V, H])
  draft         per depth: its lm_head shard, QKV + o_proj, eh_proj [H, 2H] BF16 (replicated
                on a rank here: the draft code has no TP split of it), its router, 8 experts
                per row, its KV in range (window + rows − 1)
  reductions    the emulated peer partials: 7 · rows · H · 4 per attention tail (every layer)
                and per MoE tail (every MoE layer) — benchmarks/rank/ops.py
  small         norm vectors, sink keys, q/k-norm weights, embedding rows
Writes (new K/V rows, logits, partials) are a few MB at most and are left out, as is
everything the floor of a real TP8 round would add beyond one rank (NVLink traffic).

Dimension letters: n target rows (= 1 + drafts), D draft depth, C context, E experts, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

from reference.config import FULL, ModelConfig
from reference.params import FP8_BLOCK

FP32, BF16, E4M3 = 4, 2, 1


def _b(n: int) -> int:
    return -(-n // FP8_BLOCK)


def fp8_matrix_bytes(n: int, k: int) -> int:
    """An [N, K] E4M3 weight with its [⌈N/128⌉, ⌈K/128⌉] FP32 inverse scales."""
    return n * k * E4M3 + _b(n) * _b(k) * FP32


def expert_bytes(hidden: int, inter: int) -> int:
    """One expert of the fused stacks: fc [2I, H] and proj [H, I] rows with their scales."""
    return fp8_matrix_bytes(2 * inter, hidden) + fp8_matrix_bytes(hidden, inter)


@dataclass(frozen=True)
class RoundShape:
    rows: float  # target verification rows n = 1 + drafts (mean over rounds for adaptive)
    depth: float  # draft depths run (mean over rounds for adaptive)
    context: int  # positions in the cache before the round (m)
    distinct: float  # mean distinct experts per target MoE layer over the timed rounds
    # depth 0's rows: "keep" 1, or 2 after a fully accepted round; "recompute" a + 1
    draft_rows0: float = 1.0
    peers: int = 7  # emulated peer partial buffers per tail


def floor_terms(cfg: ModelConfig, s: RoundShape) -> dict[str, float]:
    """Bytes per term (module docstring)."""
    t, d = cfg.target, cfg.draft
    h, hd, hkv = t.hidden_size, t.head_dim, t.num_key_value_heads
    attn = fp8_matrix_bytes(t.q_size + 2 * t.kv_size, h) + fp8_matrix_bytes(h, t.q_size)
    n_layers = t.num_hidden_layers
    n_moe = n_layers - 1
    kv_row = 2 * hkv * hd * BF16  # K and V of one position
    full_pos = s.context + s.rows
    slide_pos = min(t.sliding_window + s.rows - 1, full_pos)
    kv = sum(kv_row * (full_pos if kind == FULL else slide_pos) for kind in t.layer_types)
    draft_rows = s.draft_rows0 + max(s.depth - 1, 0.0)  # rows over all depths
    draft_kv_pos = min(d.sliding_window + s.draft_rows0 - 1, s.context)
    draft = (s.depth * (t.vocab_size * h * BF16 + attn + h * 2 * h * BF16
                        + d.num_experts * h * FP32 + kv_row * draft_kv_pos)
             + draft_rows * d.num_experts_per_tok * expert_bytes(h, d.moe_intermediate_size))
    small_per_layer = 4 * h * BF16 + 2 * hd * BF16 + hkv * hd * BF16
    return {
        "attention": float(n_layers * attn),
        "dense": float(2 * fp8_matrix_bytes(t.intermediate_size, h)
                       + fp8_matrix_bytes(h, t.intermediate_size)),
        "experts": float(n_moe * s.distinct * expert_bytes(h, t.moe_intermediate_size)),
        "routers": float(n_moe * t.num_experts * h * FP32),
        "kv": float(kv),
        "lm_head": float(t.vocab_size * h * BF16),
        "draft": float(draft),
        "reductions": float(s.peers * s.rows * h * FP32 * (n_layers + n_moe)),
        "small": float(n_layers * small_per_layer + h * BF16 * (1 + 2 * s.rows)),
    }


def floor_bytes(cfg: ModelConfig, s: RoundShape) -> float:
    return sum(floor_terms(cfg, s).values())


def floor_seconds(cfg: ModelConfig, s: RoundShape, bandwidth: float) -> float:
    """bandwidth: measured copy bandwidth in bytes/s (read + write of a large device copy)."""
    if not bandwidth > 0:
        raise ValueError(f"floor: bandwidth must be > 0 bytes/s, got {bandwidth}")
    return floor_bytes(cfg, s) / bandwidth


def kv_growth_bytes(cfg: ModelConfig, rows: float, c0: int, c1: int) -> float:
    """Extra KV bytes of a round at context c1 over one at c0 (full layers only grow, and
    sliding layers until their window is full)."""
    a = floor_terms(cfg, RoundShape(rows, 0.0, c0, 0.0))["kv"]
    b = floor_terms(cfg, RoundShape(rows, 0.0, c1, 0.0))["kv"]
    return b - a
