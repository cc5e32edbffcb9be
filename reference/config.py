"""IQuest-Q1 architecture configuration: the single source of truth for shapes.

The target model and its MTP draft each have a frozen dataclass; `ModelConfig` holds both plus
the sampling defaults. Field names follow the checkpoint's `config.json` / `mtp/config.json`
(see ARCHITECTURE.md); names that are not public are our choice and documented here.

Layer pattern: `[F] + [F, S, S, S] * N + [F, F, F]` — "full" and "sliding" in `layer_types`.
Sliding window counts the current token: a query at position t sees keys t-W+1 … t.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FULL = "full"
SLIDING = "sliding"


class ConfigError(ValueError):
    """A configuration field is out of range or inconsistent; the message names the field."""


def layer_pattern(n_repeats: int) -> tuple[str, ...]:
    """`[F] + [F, S, S, S] * n_repeats + [F, F, F]`."""
    return (FULL,) + (FULL, SLIDING, SLIDING, SLIDING) * n_repeats + (FULL, FULL, FULL)


def _require(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {msg}")


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 20  # 0 disables top-k (whole vocabulary)
    top_p: float = 0.95  # 1.0 disables top-p

    def validate(self, vocab_size: int, where: str = "sampling") -> None:
        _require(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            f"{where}.temperature",
            f"must be finite and >= 0, got {self.temperature}",
        )
        _require(
            isinstance(self.top_k, int) and 0 <= self.top_k <= vocab_size,
            f"{where}.top_k",
            f"must be an integer in [0, vocab_size={vocab_size}] (0 = off), got {self.top_k}",
        )
        _require(0.0 < self.top_p <= 1.0, f"{where}.top_p", f"must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class DraftConfig:
    """The MTP draft block (`mtp/config.json`): one physical layer applied recursively."""

    num_draft_slots: int = 7  # depths the draft was trained for
    num_hidden_layers: int = 1  # physical draft layers (only 1 supported)
    sliding_window: int = 512  # counts the current token
    swa_rope_theta: float = 1e4
    fp32_residual_connection: bool = True
    # The draft's FFN is an MoE with its own router; shapes copy the target's unless set.
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 1536

    def validate(self, target: TargetConfig) -> None:
        w = "draft"
        _require(1 <= self.num_draft_slots <= 16, f"{w}.num_draft_slots", "must be in [1, 16]")
        _require(self.num_hidden_layers == 1, f"{w}.num_hidden_layers", "only 1 is supported")
        _require(
            1 <= self.sliding_window < target.sliding_window,
            f"{w}.sliding_window",
            f"must be in [1, target window {target.sliding_window}), got {self.sliding_window}",
        )
        _require(self.swa_rope_theta > 0, f"{w}.swa_rope_theta", "must be > 0")
        _require(self.num_experts >= 1, f"{w}.num_experts", "must be >= 1")
        _require(
            1 <= self.num_experts_per_tok <= self.num_experts,
            f"{w}.num_experts_per_tok",
            f"must be in [1, num_experts={self.num_experts}]",
        )
        _require(self.moe_intermediate_size >= 1, f"{w}.moe_intermediate_size", "must be >= 1")


@dataclass(frozen=True)
class TargetConfig:
    """The target model (`config.json`)."""

    vocab_size: int = 160000
    hidden_size: int = 3072
    layer_types: tuple[str, ...] = layer_pattern(21)  # 88 layers
    num_attention_heads: int = 48
    num_key_value_heads: int = 8  # GQA 6:1
    head_dim: int = 128
    rotary_dim: int = 32  # NeoX rotate-half on the first rotary_dim dims of each head
    rope_theta: float = 1e6  # full-attention layers
    swa_rope_theta: float = 1e4  # sliding-window layers
    sliding_window: int = 4096  # counts the current token
    qk_norm: bool = True
    attention_sink: bool = True  # learned sink key per KV head, zero value
    rms_norm_eps: float = 1e-6
    intermediate_size: int = 12288  # dense SwiGLU on layer 0
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 1536
    attn_out_scale: float = 1.0  # layers >= 1
    ffn_out_scale: float = 0.53881590608  # layers >= 1
    max_position_embeddings: int = 524288
    quantize_lm_head: bool = False  # not public; we keep lm_head unquantized (BF16)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    def validate(self) -> None:
        w = "config"
        _require(self.vocab_size >= 2, f"{w}.vocab_size", "must be >= 2")
        _require(self.hidden_size >= 1, f"{w}.hidden_size", "must be >= 1")
        n = len(self.layer_types)
        _require(
            n >= 4 and (n - 4) % 4 == 0,
            f"{w}.layer_types",
            f"length {n} does not fit [F] + [F,S,S,S]*N + [F,F,F]",
        )
        _require(
            tuple(self.layer_types) == layer_pattern((n - 4) // 4),
            f"{w}.layer_types",
            "must be [full] + [full, sliding, sliding, sliding]*N + [full, full, full]",
        )
        _require(self.num_attention_heads >= 1, f"{w}.num_attention_heads", "must be >= 1")
        _require(self.num_key_value_heads >= 1, f"{w}.num_key_value_heads", "must be >= 1")
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"{w}.num_attention_heads",
            f"{self.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={self.num_key_value_heads}",
        )
        _require(self.head_dim >= 2 and self.head_dim % 2 == 0, f"{w}.head_dim", "must be even")
        _require(
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0,
            f"{w}.rotary_dim",
            f"must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}",
        )
        _require(self.rope_theta > 0, f"{w}.rope_theta", f"must be > 0, got {self.rope_theta}")
        _require(
            self.swa_rope_theta > 0,
            f"{w}.swa_rope_theta",
            f"must be > 0, got {self.swa_rope_theta}",
        )
        _require(self.sliding_window >= 2, f"{w}.sliding_window", "must be >= 2")
        _require(self.rms_norm_eps > 0, f"{w}.rms_norm_eps", "must be > 0")
        _require(self.intermediate_size >= 1, f"{w}.intermediate_size", "must be >= 1")
        _require(self.num_experts >= 1, f"{w}.num_experts", "must be >= 1")
        _require(
            1 <= self.num_experts_per_tok <= self.num_experts,
            f"{w}.num_experts_per_tok",
            f"must be in [1, num_experts={self.num_experts}]",
        )
        _require(self.moe_intermediate_size >= 1, f"{w}.moe_intermediate_size", "must be >= 1")
        for name in ("attn_out_scale", "ffn_out_scale"):
            _require(math.isfinite(getattr(self, name)), f"{w}.{name}", "must be finite")
        _require(
            self.max_position_embeddings > self.sliding_window,
            f"{w}.max_position_embeddings",
            "must exceed sliding_window",
        )


@dataclass(frozen=True)
class RankShapes:
    """Per-rank shapes under tensor parallelism of degree `tp` (ARCHITECTURE.md's TP8 table)."""

    tp: int
    q_heads: int
    kv_heads: int
    qkv_out: int  # (q_heads + 2 * kv_heads) * head_dim
    o_in: int
    expert_intermediate: int  # per expert, per rank
    dense_intermediate: int
    vocab: int  # rows of embedding / lm_head per rank
    expert_bytes_fp8: int  # gate + up + down of one expert on one rank


@dataclass(frozen=True)
class ModelConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    name: str = "custom"

    def __post_init__(self) -> None:
        self.target.validate()
        self.draft.validate(self.target)
        self.sampling.validate(self.target.vocab_size)

    def per_rank(self, tp: int) -> RankShapes:
        t = self.target
        _require(tp >= 1, "tp", f"must be >= 1, got {tp}")
        for name, size in (
            ("num_key_value_heads", t.num_key_value_heads),
            ("moe_intermediate_size", t.moe_intermediate_size),
            ("intermediate_size", t.intermediate_size),
            ("vocab_size", t.vocab_size),
        ):
            _require(size % tp == 0, "tp", f"{name}={size} is not divisible by tp={tp}")
        qh, kvh = t.num_attention_heads // tp, t.num_key_value_heads // tp
        ei = t.moe_intermediate_size // tp
        return RankShapes(
            tp=tp,
            q_heads=qh,
            kv_heads=kvh,
            qkv_out=(qh + 2 * kvh) * t.head_dim,
            o_in=qh * t.head_dim,
            expert_intermediate=ei,
            dense_intermediate=t.intermediate_size // tp,
            vocab=t.vocab_size // tp,
            expert_bytes_fp8=3 * t.hidden_size * ei,
        )

    # --- JSON (config.json / mtp/config.json) -------------------------------------------
    def target_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self.target)
        d["layer_types"] = list(self.target.layer_types)
        d["num_hidden_layers"] = self.target.num_hidden_layers
        d["model_type"] = "iquest_q1"
        d["name"] = self.name
        d["sampling_defaults"] = dataclasses.asdict(self.sampling)
        return d

    def draft_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self.draft)
        d["model_type"] = "iquest_q1_mtp"
        return d

    @classmethod
    def from_json(
        cls, target: dict[str, Any], draft: dict[str, Any], source: str = "config"
    ) -> ModelConfig:
        target = dict(target)
        name = target.pop("name", "custom")
        sampling = target.pop("sampling_defaults", {})
        n_layers = target.pop("num_hidden_layers", None)
        target.pop("model_type", None)
        draft = dict(draft)
        draft.pop("model_type", None)
        tnames = {f.name for f in dataclasses.fields(TargetConfig)}
        dnames = {f.name for f in dataclasses.fields(DraftConfig)}
        snames = {f.name for f in dataclasses.fields(SamplingDefaults)}
        for where, keys, allowed in (
            (f"{source}: config.json", target, tnames),
            (f"{source}: mtp/config.json", draft, dnames),
            (f"{source}: config.json sampling_defaults", sampling, snames),
        ):
            extra = sorted(set(keys) - allowed)
            if extra:
                raise ConfigError(f"{where}: unknown fields {extra}")
        for where, keys, kind in (
            (f"{source}: config.json", target, TargetConfig),
            (f"{source}: mtp/config.json", draft, DraftConfig),
            (f"{source}: config.json sampling_defaults", sampling, SamplingDefaults),
        ):
            _check_types(where, keys, kind)
        if "layer_types" in target:
            target["layer_types"] = tuple(target["layer_types"])
        t = TargetConfig(**target)
        if n_layers is not None and n_layers != t.num_hidden_layers:
            raise ConfigError(
                f"{source}: config.json num_hidden_layers={n_layers} disagrees with "
                f"len(layer_types)={t.num_hidden_layers}"
            )
        return cls(
            target=t, draft=DraftConfig(**draft), sampling=SamplingDefaults(**sampling), name=name
        )

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        (directory / "mtp").mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.target_json(), indent=2) + "\n")
        (directory / "mtp" / "config.json").write_text(
            json.dumps(self.draft_json(), indent=2) + "\n"
        )

    @classmethod
    def load(cls, directory: Path) -> ModelConfig:
        directory = Path(directory)
        files = [directory / "config.json", directory / "mtp" / "config.json"]
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{f}: missing")
        try:
            t, d = (json.loads(f.read_text()) for f in files)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{directory}: invalid JSON in a config file: {e}") from None
        return cls.from_json(t, d, source=str(directory))


def _check_types(where: str, values: dict[str, Any], kind: type) -> None:
    """JSON values must have the dataclass default's type (ints accepted for floats)."""
    defaults = {f.name: f.default for f in dataclasses.fields(kind)}
    for name, value in values.items():
        want = defaults[name]
        if isinstance(want, bool):
            ok = isinstance(value, bool)
        elif isinstance(want, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(want, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif isinstance(want, tuple):
            ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        else:
            ok = True
        if not ok:
            raise ConfigError(
                f"{where}: field {name!r} must be {type(want).__name__}, got {value!r}"
            )


def preset(name: str) -> ModelConfig:
    """`iquest-q1`: the real shapes. `tiny`: the same structure, small enough for CPU tests."""
    if name == "iquest-q1":
        return ModelConfig(name="iquest-q1")
    if name == "tiny":
        return ModelConfig(
            name="tiny",
            target=TargetConfig(
                vocab_size=512,
                hidden_size=128,
                layer_types=layer_pattern(1),  # F F S S S F F F
                num_attention_heads=12,
                num_key_value_heads=2,
                head_dim=32,
                rotary_dim=8,
                sliding_window=16,
                intermediate_size=256,
                num_experts=16,
                num_experts_per_tok=4,
                moe_intermediate_size=64,
                max_position_embeddings=4096,
            ),
            draft=DraftConfig(
                sliding_window=8, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64
            ),
        )
    if name == "mini":
        # The trainable preset (training/): vocab 8192 (the shipped tokenizer), every matrix dim a
        # multiple of 128 (whole 128x128 FP8 blocks). Sized so the E4M3 checkpoint fits 20 MB
        # with its tokenizer: three [V, H] BF16 tables (both embeddings, draft lm_head) plus an
        # E4M3 target lm_head cost 7·V·H bytes, hence H = 128 (training/README.md has the sums).
        return ModelConfig(
            name="mini",
            target=TargetConfig(
                vocab_size=8192,
                hidden_size=128,
                layer_types=layer_pattern(1),  # F F S S S F F F
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                rotary_dim=16,
                sliding_window=128,
                intermediate_size=512,
                num_experts=24,
                num_experts_per_tok=4,
                moe_intermediate_size=128,
                max_position_embeddings=4096,
                quantize_lm_head=True,
            ),
            draft=DraftConfig(
                sliding_window=64, num_experts=24, num_experts_per_tok=4, moe_intermediate_size=128
            ),
        )
    raise ConfigError(f"preset: unknown preset {name!r}; choose one of {PRESETS}")


PRESETS = ("iquest-q1", "tiny", "mini")
