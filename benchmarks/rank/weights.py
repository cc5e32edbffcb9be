"""Random weights of a rank, built directly on the device in the runtime's native formats
(iquestrt/weights.py structs): E4M3 block weights with FP32 inverse scales, BF16 plain tensors,
FP32 routers. No checkpoint: every tensor is allocated once and filled in place from one seeded
torch.Generator, so peak memory is the weights themselves (no FP32 staging copy).

E4M3 values: uniform random bytes with bit 6 cleared, i.e. a random sign and an exponent field
≤ 7, so every value is finite with |w| ≤ 1.875 (no NaN code 0x7F/0xFF can occur). Each block's
inverse scale is 1 / (rms(code values) · √K), so a projection maps unit-RMS rows to unit-RMS
outputs and 88 layers stay finite. Norm weights are 1; embeddings, sink keys, eh_proj and the
lm_heads are N(0, σ²) BF16 with σ chosen the same way.

Dimension letters: V vocabulary, H hidden, N out channels, K in columns, E experts, I expert
intermediate, F dense intermediate, Hkv KV heads, D head dim.
"""

from __future__ import annotations

import math

import torch

from iquestrt.weights import (
    AttnWeights,
    DenseWeights,
    DraftWeights,
    Fp8Linear,
    MoeWeights,
    TargetLayer,
    Weights,
    _check_runtime_shapes,
)
from kernels.qk_rope import RopeTable, rope_table
from reference.config import FULL, ModelConfig
from reference.params import FP8_BLOCK

E4M3_MASK = 0xBF  # clear bit 6: exponent field ≤ 7 → finite, |w| ≤ 1.875
CHUNK_BYTES = 1 << 28  # fill big tensors in slices of about this many bytes


def e4m3_code_rms() -> float:
    """RMS of the E4M3 values a masked random byte can take (all 256 bytes equally likely)."""
    codes = torch.arange(256, dtype=torch.int32).bitwise_and(E4M3_MASK).to(torch.uint8)
    return float(codes.view(torch.float8_e4m3fn).float().pow(2).mean().sqrt())


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


class RandomWeights:
    def __init__(self, cfg: ModelConfig, device, seed: int):
        self.cfg, self.dev = cfg, torch.device(device)
        self.g = torch.Generator(device=self.dev)
        self.g.manual_seed(seed)
        self.code_rms = e4m3_code_rms()

    def _slices(self, t: torch.Tensor):
        """Views of t along dim 0 of about CHUNK_BYTES each (in-place fills stay small)."""
        row = max(1, t[0].numel() * t.element_size()) if t.dim() else 1
        step = max(1, CHUNK_BYTES // row)
        return t.split(step) if t.dim() else (t,)

    def e4m3(self, *shape: int) -> torch.Tensor:
        raw = torch.empty(shape, dtype=torch.uint8, device=self.dev)
        for part in self._slices(raw):
            part.random_(0, 256, generator=self.g)
            part.bitwise_and_(E4M3_MASK)
        return raw.view(torch.float8_e4m3fn)

    def fp8(self, n: int, k: int) -> Fp8Linear:
        s = torch.full((_blocks(n), _blocks(k)), 1.0 / (self.code_rms * math.sqrt(k)),
                       dtype=torch.float32, device=self.dev)
        return Fp8Linear(self.e4m3(n, k), s)

    def normal(self, *shape: int, std: float, dtype=torch.bfloat16) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.dev)
        for part in self._slices(t):
            part.normal_(0.0, std, generator=self.g)
        return t

    def ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16, device=self.dev)

    def attn(self) -> AttnWeights:
        t = self.cfg.target
        h, d = t.hidden_size, t.head_dim
        return AttnWeights(
            self.ones(h), self.fp8(t.q_size + 2 * t.kv_size, h), self.fp8(h, t.q_size),
            self.ones(d), self.ones(d), self.normal(t.num_key_value_heads, d, std=1.0),
            self.ones(h), self.ones(h))

    def moe(self, experts: int, top_k: int, inter: int) -> MoeWeights:
        h = self.cfg.target.hidden_size
        fc_s = torch.full((experts, _blocks(2 * inter), _blocks(h)),
                          1.0 / (self.code_rms * math.sqrt(h)), device=self.dev)
        proj_s = torch.full((experts, _blocks(h), _blocks(inter)),
                            1.0 / (self.code_rms * math.sqrt(inter)), device=self.dev)
        router = self.normal(experts, h, std=1.0 / math.sqrt(h), dtype=torch.float32)
        return MoeWeights(router, self.e4m3(experts, 2 * inter, h), fc_s,
                          self.e4m3(experts, h, inter), proj_s, top_k)


def random_weights(cfg: ModelConfig, device, seed: int, max_positions: int) -> Weights:
    """A full set of runtime weights for `cfg` (shapes as iquestrt.weights.from_checkpoint would
    load them), RoPE tables for positions < max_positions."""
    _check_runtime_shapes(cfg, f"benchmarks.rank ({cfg.name})")
    t, d = cfg.target, cfg.draft
    if not 1 <= max_positions <= t.max_position_embeddings:
        raise ValueError(f"max_positions: {max_positions} outside [1, "
                         f"max_position_embeddings={t.max_position_embeddings}]")
    r = RandomWeights(cfg, device, seed)
    h, v = t.hidden_size, t.vocab_size
    ropes: dict[float, RopeTable] = {}

    def rope(theta: float) -> RopeTable:
        if theta not in ropes:
            ropes[theta] = rope_table(max_positions, t.rotary_dim, theta, r.dev)
        return ropes[theta]

    layers = []
    for i, kind in enumerate(t.layer_types):
        full = kind == FULL
        dense = moe = None
        if i == 0:
            dense = DenseWeights(r.fp8(t.intermediate_size, h), r.fp8(t.intermediate_size, h),
                                 r.fp8(h, t.intermediate_size), r.ones(h))
        else:
            moe = r.moe(t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size)
        layers.append(TargetLayer(i, None if full else t.sliding_window,
                                  rope(t.rope_theta if full else t.swa_rope_theta),
                                  r.attn(), dense, moe))
    std_v = 1.0 / math.sqrt(h)
    draft = DraftWeights(
        r.normal(v, h, std=1.0), r.ones(h), r.ones(h),
        r.normal(h, 2 * h, std=1.0 / math.sqrt(2 * h)), r.attn(), r.ones(h),
        r.moe(d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size), r.ones(h),
        r.normal(v, h, std=2 * std_v), d.sliding_window, rope(d.swa_rope_theta))
    lm_head = r.fp8(v, h) if t.quantize_lm_head else r.normal(v, h, std=2 * std_v)
    return Weights(cfg, r.dev, max_positions, r.normal(v, h, std=1.0), tuple(layers),
                   r.ones(h), lm_head, draft)


def weight_bytes(w: Weights) -> int:
    """Bytes of every weight tensor (RoPE tables excluded)."""
    seen: set[int] = set()
    total = 0

    def walk(x) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            if x.data_ptr() not in seen:
                seen.add(x.data_ptr())
                total += x.numel() * x.element_size()
        elif isinstance(x, RopeTable):
            return
        elif hasattr(x, "__dataclass_fields__"):
            for name in x.__dataclass_fields__:
                if name not in ("cfg", "device", "max_positions"):
                    walk(getattr(x, name))
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)

    walk(w)
    return total
