"""IQuest-Q1 architecture configuration: the single source of truth for shapes.

The target model and its MTP draft each have a frozen dataclass; `ModelConfig` holds both plus
the sampling defaults and the end-of-sequence ids. `save` writes this runtime's field names;
`load` / `from_json` also read the names of the public SGLang and vLLM IQuest-Q1 config classes,
mapped by their public meaning (the tables after `ModelConfig`; docs/public_conventions.md has
the same mapping as one table, with where each public name comes from). One name differs in
meaning: public `intermediate_size` is the expert width (ours: `moe_intermediate_size`), public
`dense_intermediate_size` the dense layer-0 width (ours: `intermediate_size`).

Layer pattern: `[F] + [F, S, S, S] * N + [F, F, F]` — "full" and "sliding" in `layer_types`.
Sliding window counts the current token: a query at position t sees keys t-W+1 … t.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
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


# RoPE bases: public models use 1e4 … 1e7; above 1e12 every frequency but the first rounds to 0
MAX_ROPE_THETA = 1e12


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


DRAFT_KV_SETTLE = ("recompute", "keep")


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
    # Draft conventions (docs/public_conventions.md); neither is a public field, and the
    # defaults are the public integrations'. A row holds (token at p, hidden of p − 1).
    draft_position_offset: int = -1  # its RoPE position is p + this: −1 that of the hidden state
    # after verification accepted a of the round's drafts (round at m): "recompute" keeps the
    # draft rows < m + 1 and the next depth 0 rewrites m + 1 … m + a + 1 from the target's hidden
    # states; "keep" keeps the rows < m + a + 1 the depths wrote from the draft's own hidden
    draft_kv_settle: str = "recompute"

    def validate(self, target: TargetConfig) -> None:
        w = "draft"
        _require(1 <= self.num_draft_slots <= 16, f"{w}.num_draft_slots", "must be in [1, 16]")
        _require(self.num_hidden_layers == 1, f"{w}.num_hidden_layers", "only 1 is supported")
        _require(
            1 <= self.sliding_window < target.sliding_window,
            f"{w}.sliding_window",
            f"must be in [1, target window {target.sliding_window}), got {self.sliding_window}",
        )
        _require(1.0 < self.swa_rope_theta <= MAX_ROPE_THETA, f"{w}.swa_rope_theta",
                 f"must be in (1, {MAX_ROPE_THETA:g}], got {self.swa_rope_theta}")
        _require(self.num_experts >= 1, f"{w}.num_experts", "must be >= 1")
        _require(
            1 <= self.num_experts_per_tok <= self.num_experts,
            f"{w}.num_experts_per_tok",
            f"must be in [1, num_experts={self.num_experts}]",
        )
        _require(self.moe_intermediate_size >= 1, f"{w}.moe_intermediate_size", "must be >= 1")
        _require(self.draft_position_offset in (0, -1), f"{w}.draft_position_offset",
                 f"must be 0 (the token's position) or -1 (the hidden state's), got "
                 f"{self.draft_position_offset!r}")
        _require(self.draft_kv_settle in DRAFT_KV_SETTLE, f"{w}.draft_kv_settle",
                 f"must be one of {', '.join(DRAFT_KV_SETTLE)}, got {self.draft_kv_settle!r}")

    @property
    def recompute_settled(self) -> bool:
        """The next depth 0 recomputes the accepted rows from the target's hidden states."""
        return self.draft_kv_settle == "recompute"

    def settled_draft_next(self, m, emitted, ran=1):
        """The draft cache's next position after a round at m that emitted `emitted` tokens
        (a + 1), before capping at the rows actually written: "keep" keeps the rows of accepted
        depths (≤ m+a), "recompute" keeps ≤ m. Ints, or tensors with `ran` ∈ {0, 1} marking
        the rows that ran a round (emitted is then 0 where ran is 0)."""
        return m + ran if self.recompute_settled else m + emitted


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
        for name in ("rope_theta", "swa_rope_theta"):
            theta = getattr(self, name)
            _require(1.0 < theta <= MAX_ROPE_THETA, f"{w}.{name}",
                     f"must be in (1, {MAX_ROPE_THETA:g}], got {theta}")
        _require(self.sliding_window >= 2, f"{w}.sliding_window", "must be >= 2")
        _require(0 < self.rms_norm_eps < 1, f"{w}.rms_norm_eps",
                 f"must be in (0, 1), got {self.rms_norm_eps}")
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
    """Per-rank shapes under tensor parallelism of degree `tp` (IQuest-Q1 at TP8: 6 query heads
    and 1 KV head, experts of 1536 / 8 = 192 channels, vocabulary 160 000 / 8 = 20 000 rows)."""

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
    # End-of-sequence ids (`eos_token_id` of config.json and generation_config.json): a request
    # that names no stop ids of its own stops at any of these.
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.target.validate()
        self.draft.validate(self.target)
        self.sampling.validate(self.target.vocab_size)
        ids = self.eos_token_ids
        _require(
            isinstance(ids, tuple) and all(_is_int(i) for i in ids),
            "config.eos_token_ids",
            f"must be a tuple of integers, got {ids!r}",
        )
        bad = [i for i in ids if not 0 <= i < self.target.vocab_size]
        _require(
            not bad,
            "config.eos_token_ids",
            f"{bad} outside [0, vocab_size={self.target.vocab_size})",
        )
        _require(len(set(ids)) == len(ids), "config.eos_token_ids", f"repeats an id: {ids}")

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
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids)
        return d

    def draft_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self.draft)
        d["model_type"] = "iquest_q1_mtp"
        return d

    @classmethod
    def from_json(
        cls,
        target: dict[str, Any],
        draft: dict[str, Any],
        source: str = "config",
        generation: dict[str, Any] | None = None,
    ) -> ModelConfig:
        """The config of config.json (`target`), mtp/config.json (`draft`) and, when the
        checkpoint has one, generation_config.json (`generation`). Each file may use this
        runtime's field names, the public integrations' names (the tables below), or both;
        a name that is neither is an error naming the file and the field."""
        t_kw, eos, name, own_sampling = _read_target(target, f"{source}: config.json")
        t = TargetConfig(**t_kw)
        d = DraftConfig(**_read_draft(draft, f"{source}: mtp/config.json", t))
        sampling = _Fields(source, SamplingDefaults)
        for key, value in own_sampling.items():
            sampling.put(key, f"config.json sampling_defaults.{key}", value)
        if generation is not None:
            g_eos, g_sampling = _read_generation(generation, f"{source}: generation_config.json")
            eos += tuple(i for i in g_eos if i not in eos)
            for key, (label, value) in g_sampling.items():
                sampling.put(key, f"generation_config.json {label}", value)
        return cls(
            target=t,
            draft=d,
            sampling=SamplingDefaults(**sampling.kwargs()),
            name=name,
            eos_token_ids=eos,
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
        """config.json and mtp/config.json (both required) and generation_config.json (read
        when present) of a checkpoint directory."""
        directory = Path(directory)
        files = [directory / "config.json", directory / "mtp" / "config.json"]
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{f}: missing")
        generation = directory / GENERATION_CONFIG
        t, d = (_read_json_object(f) for f in files)
        g = _read_json_object(generation) if generation.is_file() else None
        return cls.from_json(t, d, source=str(directory), generation=g)


GENERATION_CONFIG = "generation_config.json"


def _no_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf
        raise ValueError(f"{text} is not a finite number")
    return value


MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KB; bigger is not a config


def _read_json_object(path: Path) -> dict[str, Any]:
    """A config file's JSON object: NaN / Infinity refused, nesting and size bounded."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ConfigError(f"{path}: unreadable: {e.strerror or e}") from None
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {size} bytes; a config file is at most {MAX_CONFIG_BYTES}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constant,
                           parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from None
    except ValueError as e:  # a NaN / Infinity constant
        raise ConfigError(f"{path}: invalid JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid JSON: nested too deeply") from None
    except OSError as e:
        raise ConfigError(f"{path}: unreadable: {e.strerror or e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value


# --- public config names ---------------------------------------------------------------------
#
# The public SGLang and vLLM integrations of IQuest-Q1 read config.json and mtp/config.json
# through their own config classes (docs/public_conventions.md says where). Every field those
# classes define is accepted here and falls in exactly one group:
#   * this runtime's own name with the same meaning (the dataclass fields above);
#   * TARGET_RENAMED / DRAFT_RENAMED: a public name mapped to our field by its public meaning;
#   * the layer-pattern, RoPE, softmax-scale, eos and target-copy fields, read by the functions
#     below (TARGET_READ / DRAFT_READ);
#   * TARGET_FIXED / DRAFT_FIXED: settings this runtime implements in one way only; any other
#     value is an error;
#   * TARGET_UNUSED / DRAFT_UNUSED / GENERATION_UNUSED: known fields this runtime does not use,
#     each with the reason.
# A key that two names give (ours and a public one, or two public spellings) must agree.

PUBLIC_LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING}

# public name -> our TargetConfig field
TARGET_RENAMED = {
    "dense_intermediate_size": "intermediate_size",  # the dense SwiGLU width of layer 0
    # The expert width. A file that also carries our `moe_intermediate_size` is written in our
    # names, and there `intermediate_size` is our field: the dense width.
    "intermediate_size": "moe_intermediate_size",
    "enable_sink_attention": "attention_sink",
}
# public name -> our DraftConfig field
DRAFT_RENAMED = {"intermediate_size": "moe_intermediate_size"}  # the draft's expert width

# Read by _read_target / _read_draft (how: docs/public_conventions.md).
TARGET_READ = (
    "layer_types",  # also spelled full_attention / sliding_attention
    "first_layers_types",  # with the next three: first + block * num_blocks + last
    "hybrid_layers_types_block",
    "num_hybrid_layers_block",
    "last_layers_types",
    "hybrid_layer_pattern",  # 1 = sliding, 0 = full, per layer
    "is_hybrid_swa",  # true iff a sliding layer exists
    "num_hidden_layers",  # len(layer_types)
    "rope_parameters",  # rope_type "default"; rope_theta; partial_rotary_factor = rotary/head
    "rope_scaling",  # none, or rope_type "default"
    "softmax_scale",  # none or 1/sqrt(head_dim)
    "eos_token_id",  # int or list -> ModelConfig.eos_token_ids
)
DRAFT_READ = (
    "target_config",  # copy of config.json: hidden_size, vocab_size, num_hidden_layers checked
    "num_target_layers",  # = the target's num_hidden_layers
    "rope_parameters",
    "rope_scaling",
    "softmax_scale",
    # The draft's attention and embedding shapes are the target's (IQuest-Q1's MTP layer); the
    # public draft config carries copies, each checked against config.json.
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rotary_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "enable_sink_attention",
)

_COMMON_FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "hidden_act": (("silu",), "the FFNs are SiLU-gated"),
    "moe_router_dtype": (("fp32",), "routers run in FP32"),
    "enable_lm_head_fp32": ((True,), "logits are computed in FP32"),
    "attention_bias": ((False,), "no projection has a bias"),
    "tie_word_embeddings": ((False,), "lm_head is a separate matrix"),
    "logit_scale": ((1.0,), "logits are not rescaled"),
    "no_rope_layers": (([],), "every layer applies RoPE"),
    "use_hybrid_layers": ((True,), "layer types follow the hybrid pattern"),
    "use_sliding_window": ((True,), "sliding layers have a window"),
    "use_over_encoding": ((False,), "embeddings are one table lookup"),
    "shared_kv_num_layers": ((0,), "every layer has its own KV"),
    "first_layer_attn_out_scale": ((1.0,), "layer 0 (and the draft) add attention unscaled"),
    "first_layer_ffn_out_scale": ((1.0,), "layer 0 (and the draft) add the FFN unscaled"),
}
TARGET_FIXED = {
    **_COMMON_FIXED,
    "model_type": (("iquest_q1",), "the target model"),
    "mlp_only_layers": (([0],), "layer 0 is the only dense FFN"),
}
DRAFT_FIXED = {
    **_COMMON_FIXED,
    "model_type": (("iquest_q1_mtp", "iquest_q1_mtp_recursive"), "the recursive MTP draft"),
    "mlp_only_layers": (([],), "the draft's FFN is an MoE"),
    "layer_types": ((["sliding_attention"],), "the draft layer is windowed"),
    "first_layers_types": ((["sliding_attention"],), "the draft layer is windowed"),
    "hybrid_layers_types_block": (([],), "one draft layer"),
    "num_hybrid_layers_block": ((0,), "one draft layer"),
    "last_layers_types": (([],), "one draft layer"),
    "hybrid_layer_pattern": (([1],), "the draft layer is windowed"),
    "is_hybrid_swa": ((True,), "the draft layer is windowed"),
}

_COMMON_UNUSED = {
    "architectures": "loader class names; this runtime has one target and one draft class",
    "dtype": "the checkpoint index and the tensors carry their dtypes",
    "torch_dtype": "the checkpoint index and the tensors carry their dtypes",
    "transformers_version": "provenance of the file",
    "_name_or_path": "provenance of the file",
    "auto_map": "remote-code class paths; not used",
    "use_cache": "a Hugging Face generate() switch; this runtime always keeps KV caches",
    "attention_dropout": "training only",
    "pad_token_id": "one request at a time: nothing is padded",
    "bos_token_id": "prompts arrive as token ids; the tokenizer adds BOS",
    "num_mtp_layers": "trained MTP heads stored in the target checkpoint; the served draft is mtp/",
    "quantization_config": "the index metadata.format and the _scale_inv tensors give the format",
    "shared_kv_source_begin": "used only when shared_kv_num_layers > 0",
    "shared_kv_target_begin": "used only when shared_kv_num_layers > 0",
}
TARGET_UNUSED = dict(_COMMON_UNUSED)
DRAFT_UNUSED = {
    **_COMMON_UNUSED,
    "eos_token_id": "stops come from config.json and generation_config.json",
    "dense_intermediate_size": "copied from the target; the draft has no dense FFN",
    "attn_out_scale": "copied from the target; the draft block uses the layer-0 scales",
    "ffn_out_scale": "copied from the target; the draft block uses the layer-0 scales",
    "rope_theta": "copied from the target; the windowed draft layer uses swa_rope_theta",
}
GENERATION_UNUSED = {
    "bos_token_id": "prompts arrive as token ids; the tokenizer adds BOS",
    "pad_token_id": "one request at a time: nothing is padded",
    "transformers_version": "provenance of the file",
    "_from_model_config": "provenance of the file",
}
# generation_config.json name -> our SamplingDefaults field; `do_sample: false` means greedy
GENERATION_SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p"}

_PATTERN_KEYS = (
    "first_layers_types",
    "hybrid_layers_types_block",
    "num_hybrid_layers_block",
    "last_layers_types",
)
_PUBLIC_PATTERN_DEFAULTS = {  # the public config class's defaults: the 88-layer pattern
    "first_layers_types": ["full_attention"],
    "hybrid_layers_types_block": ["full_attention"] + ["sliding_attention"] * 3,
    "num_hybrid_layers_block": 21,
    "last_layers_types": ["full_attention"] * 3,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _typed(where: str, key: str, value: Any, want: Any) -> Any:
    """`value` with the type of `want` (a dataclass default; ints accepted for floats)."""
    if isinstance(want, bool):
        ok = isinstance(value, bool)
    elif isinstance(want, int):
        ok = _is_int(value)
    elif isinstance(want, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(want, tuple):
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    else:
        ok = True
    if not ok:
        raise ConfigError(f"{where}: field {key!r} must be {type(want).__name__}, got {value!r}")
    return value


class _Fields:
    """Values of one dataclass's fields gathered from the keys of a file; two keys that set one
    field must agree (the error names both)."""

    def __init__(self, where: str, kind: type):
        self.where = where
        self.defaults = {f.name: f.default for f in dataclasses.fields(kind)}
        self.got: dict[str, tuple[str, Any]] = {}

    def put(self, name: str, key: str, value: Any) -> None:
        value = _typed(self.where, key, value, self.defaults[name])
        if name in self.got:
            key0, value0 = self.got[name]
            if value0 != value:
                raise ConfigError(
                    f"{self.where}: {key0!r}={value0!r} and {key!r}={value!r} disagree "
                    f"(both give {name})"
                )
            return
        self.got[name] = (key, value)

    def value(self, name: str) -> Any:
        return self.got[name][1] if name in self.got else self.defaults[name]

    def kwargs(self) -> dict[str, Any]:
        return {name: value for name, (_, value) in self.got.items()}


def _same(value: Any, want: Any) -> bool:
    """JSON equality that keeps true apart from 1 (and allows 1 for 1.0)."""
    if isinstance(want, bool) or isinstance(value, bool):
        return value is want
    if isinstance(want, float):
        return isinstance(value, (int, float)) and value == want
    if isinstance(want, list):
        return isinstance(value, list) and len(value) == len(want) and all(
            _same(v, w) for v, w in zip(value, want, strict=True)
        )
    return type(value) is type(want) and value == want


def _check_fixed(where: str, d: dict[str, Any], fixed: dict[str, tuple[tuple[Any, ...], str]]):
    for key, (allowed, meaning) in fixed.items():
        if key in d and not any(_same(d[key], a) for a in allowed):
            want = " or ".join(json.dumps(a) for a in allowed)
            raise ConfigError(
                f"{where}: field {key!r}={d[key]!r} is not supported: this runtime implements "
                f"only {want} ({meaning})"
            )


def _check_known(where: str, d: dict[str, Any], *known: Any) -> None:
    allowed = set().union(*(set(k) for k in known))
    extra = sorted(set(d) - allowed)
    if extra:
        raise ConfigError(
            f"{where}: unknown fields {extra} (neither this runtime's names nor the public "
            "IQuest-Q1 config names: docs/public_conventions.md)"
        )


def _layer_list(where: str, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: field {key!r} must be a list of layer types, got {value!r}")
    spell = {FULL: FULL, SLIDING: SLIDING, **PUBLIC_LAYER_TYPES}
    bad = sorted({v for v in value if v not in spell})
    if bad:
        raise ConfigError(
            f"{where}: field {key!r} holds unknown layer types {bad}; expected {sorted(spell)}"
        )
    return tuple(spell[v] for v in value)


def _read_layers(where: str, d: dict[str, Any], fields_: _Fields) -> None:
    """layer_types from `layer_types`, the public block pattern and `hybrid_layer_pattern`;
    then num_hidden_layers and is_hybrid_swa are checked against it."""
    if "layer_types" in d:
        layers = _layer_list(where, "layer_types", d["layer_types"])
        fields_.put("layer_types", "layer_types", layers)
    if any(k in d for k in _PATTERN_KEYS):
        parts = {k: d.get(k, _PUBLIC_PATTERN_DEFAULTS[k]) for k in _PATTERN_KEYS}
        n = parts["num_hybrid_layers_block"]
        if not _is_int(n) or n < 0:
            raise ConfigError(
                f"{where}: field 'num_hybrid_layers_block' must be an integer >= 0, got {n!r}"
            )
        pattern = (
            _layer_list(where, "first_layers_types", parts["first_layers_types"])
            + _layer_list(where, "hybrid_layers_types_block", parts["hybrid_layers_types_block"])
            * n
            + _layer_list(where, "last_layers_types", parts["last_layers_types"])
        )
        fields_.put("layer_types", "/".join(k for k in _PATTERN_KEYS if k in d), pattern)
    if "hybrid_layer_pattern" in d:
        p = d["hybrid_layer_pattern"]
        if not isinstance(p, list) or not all(_is_int(v) and v in (0, 1) for v in p):
            raise ConfigError(
                f"{where}: field 'hybrid_layer_pattern' must be a list of 0 (full) and 1 "
                f"(sliding), got {p!r}"
            )
        fields_.put("layer_types", "hybrid_layer_pattern", tuple(SLIDING if v else FULL for v in p))
    layers = fields_.value("layer_types")
    n_layers = d.get("num_hidden_layers")
    if n_layers is not None and not _is_int(n_layers):
        raise ConfigError(f"{where}: field 'num_hidden_layers' must be int, got {n_layers!r}")
    if n_layers is not None and n_layers != len(layers):
        raise ConfigError(
            f"{where} num_hidden_layers={n_layers} disagrees with len(layer_types)={len(layers)}"
        )
    if "is_hybrid_swa" in d and d["is_hybrid_swa"] is not (SLIDING in layers):
        raise ConfigError(
            f"{where}: field 'is_hybrid_swa'={d['is_hybrid_swa']!r} disagrees with layer_types "
            f"(sliding layers: {SLIDING in layers})"
        )


def _read_rope(
    where: str,
    d: dict[str, Any],
    rope_theta: Callable[[str, Any], None] | None,
    rotary_dim: Callable[[str, Any], None],
    head_dim: int,
) -> None:
    """`rope_scaling` must be off and `rope_parameters` unscaled; the RoPE base and the rotated
    dims it restates go to `rope_theta(key, value)` (None: the base is not read) and
    `rotary_dim(key, partial_rotary_factor * head_dim)`."""
    scaling = d.get("rope_scaling")
    if scaling is not None and not (
        isinstance(scaling, dict)
        and set(scaling) <= {"type", "rope_type"}
        and all(v == "default" for v in scaling.values())
    ):
        raise ConfigError(
            f"{where}: field 'rope_scaling'={scaling!r} is not supported: RoPE is unscaled"
        )
    params = d.get("rope_parameters")
    if params is None:
        return
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: field 'rope_parameters' must be an object, got {params!r}")
    extra = sorted(set(params) - {"type", "rope_type", "rope_theta", "partial_rotary_factor"})
    if extra:
        raise ConfigError(
            f"{where}: rope_parameters holds {extra}: RoPE scaling is not supported"
        )
    for key in ("type", "rope_type"):
        if key in params and params[key] != "default":
            raise ConfigError(
                f"{where}: field 'rope_parameters.{key}'={params[key]!r} is not supported: "
                "RoPE is unscaled ('default')"
            )
    if "rope_theta" in params and rope_theta is not None:
        rope_theta("rope_parameters.rope_theta", params["rope_theta"])
    if "partial_rotary_factor" in params:
        f = params["partial_rotary_factor"]
        if not isinstance(f, (int, float)) or isinstance(f, bool) or f <= 0:
            raise ConfigError(
                f"{where}: field 'rope_parameters.partial_rotary_factor' must be a number > 0, "
                f"got {f!r}"
            )
        dims = f * head_dim
        if abs(dims - round(dims)) > 1e-9:
            raise ConfigError(
                f"{where}: rope_parameters.partial_rotary_factor={f} times head_dim={head_dim} "
                "is not a whole number of dims"
            )
        rotary_dim("rope_parameters.partial_rotary_factor*head_dim", round(dims))


def _check_softmax_scale(where: str, d: dict[str, Any], head_dim: int) -> None:
    s = d.get("softmax_scale")
    if s is not None and not (
        isinstance(s, (int, float))
        and not isinstance(s, bool)
        and math.isclose(s, head_dim**-0.5, rel_tol=1e-9)
    ):
        raise ConfigError(
            f"{where}: field 'softmax_scale'={s!r} is not supported: attention scales by "
            f"1/sqrt(head_dim) = {head_dim**-0.5}"
        )


def _eos_ids(where: str, key: str, value: Any) -> tuple[int, ...]:
    ids = [] if value is None else [value] if _is_int(value) else value
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
        raise ConfigError(
            f"{where}: field {key!r} must be an integer or a list of integers, got {value!r}"
        )
    return tuple(dict.fromkeys(ids))


def _read_target(
    raw: dict[str, Any], where: str
) -> tuple[dict[str, Any], tuple[int, ...], str, dict[str, Any]]:
    """(TargetConfig kwargs, eos ids, name, our sampling_defaults) of config.json."""
    d = dict(raw)
    ours = {f.name for f in dataclasses.fields(TargetConfig)}
    public = (TARGET_RENAMED, TARGET_READ, TARGET_FIXED, TARGET_UNUSED)
    _check_known(where, d, ours, ("name", "sampling_defaults"), *public)
    _check_fixed(where, d, TARGET_FIXED)
    name = d.get("name", "custom")
    if not isinstance(name, str):
        raise ConfigError(f"{where}: field 'name' must be str, got {name!r}")
    sampling = d.get("sampling_defaults", {})
    if not isinstance(sampling, dict):
        raise ConfigError(f"{where}: field 'sampling_defaults' must be an object")
    s_names = [f.name for f in dataclasses.fields(SamplingDefaults)]
    _check_known(f"{where} sampling_defaults", sampling, s_names)
    got = _Fields(where, TargetConfig)
    ours_ffn = "moe_intermediate_size" in d
    for key, value in d.items():
        if key == "layer_types":
            continue
        if key == "intermediate_size" and ours_ffn:
            got.put(key, f"{key} (the dense width: the file names moe_intermediate_size)", value)
        elif key in ours and key != "intermediate_size":
            got.put(key, key, value)
        elif key in TARGET_RENAMED:
            got.put(TARGET_RENAMED[key], key, value)
    _read_layers(where, d, got)
    head_dim = got.value("head_dim")
    _read_rope(
        where,
        d,
        lambda k, v: got.put("rope_theta", k, v),
        lambda k, v: got.put("rotary_dim", k, v),
        head_dim,
    )
    _check_softmax_scale(where, d, head_dim)
    eos = _eos_ids(where, "eos_token_id", d.get("eos_token_id"))
    return got.kwargs(), eos, name, sampling


def _read_draft(raw: dict[str, Any], where: str, target: TargetConfig) -> dict[str, Any]:
    """DraftConfig kwargs of mtp/config.json; the public copies of target fields must match."""
    d = dict(raw)
    ours = {f.name for f in dataclasses.fields(DraftConfig)}
    _check_known(where, d, ours, DRAFT_RENAMED, DRAFT_READ, DRAFT_FIXED, DRAFT_UNUSED)
    _check_fixed(where, d, DRAFT_FIXED)
    got = _Fields(where, DraftConfig)
    for key, value in d.items():
        if key in ours:
            got.put(key, key, value)
        elif key in DRAFT_RENAMED:
            got.put(DRAFT_RENAMED[key], key, value)
    copies = {  # public key -> (the target's value, its config.json name)
        "hidden_size": (target.hidden_size, "hidden_size"),
        "vocab_size": (target.vocab_size, "vocab_size"),
        "num_attention_heads": (target.num_attention_heads, "num_attention_heads"),
        "num_key_value_heads": (target.num_key_value_heads, "num_key_value_heads"),
        "head_dim": (target.head_dim, "head_dim"),
        "rotary_dim": (target.rotary_dim, "rotary_dim"),
        "rms_norm_eps": (target.rms_norm_eps, "rms_norm_eps"),
        "max_position_embeddings": (target.max_position_embeddings, "max_position_embeddings"),
        "enable_sink_attention": (target.attention_sink, "attention_sink"),
        "num_target_layers": (target.num_hidden_layers, "num_hidden_layers"),
    }

    def same_as_target(key: str, value: Any, want: Any, what: str) -> None:
        if not _same(value, want):
            raise ConfigError(
                f"{where}: field {key!r}={value!r} disagrees with config.json ({what}={want!r})"
            )

    for key, (want, what) in copies.items():
        if key in d:
            same_as_target(key, d[key], want, what)
    tc = d.get("target_config")
    if tc is not None:
        if not isinstance(tc, dict):
            raise ConfigError(f"{where}: field 'target_config' must be an object, got {tc!r}")
        for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
            if key in tc:
                want = target.num_hidden_layers if key == "num_hidden_layers" else copies[key][0]
                same_as_target(f"target_config.{key}", tc[key], want, key)
    _read_rope(
        where,
        d,
        None,
        lambda k, v: same_as_target(k, v, target.rotary_dim, "rotary_dim"),
        target.head_dim,
    )
    _check_softmax_scale(where, d, target.head_dim)
    return got.kwargs()


def _read_generation(
    raw: dict[str, Any], where: str
) -> tuple[tuple[int, ...], dict[str, tuple[str, Any]]]:
    """(eos ids, our sampling field -> (public key, value)) of generation_config.json."""
    d = dict(raw)
    _check_known(where, d, ("eos_token_id", "do_sample"), GENERATION_SAMPLING, GENERATION_UNUSED)
    sampling = {GENERATION_SAMPLING[k]: (k, d[k]) for k in GENERATION_SAMPLING if k in d}
    do_sample = d.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ConfigError(f"{where}: field 'do_sample' must be bool, got {do_sample!r}")
    if do_sample is False:
        if "temperature" in d and d["temperature"] != 0:
            raise ConfigError(
                f"{where}: 'do_sample'=false (greedy) and 'temperature'={d['temperature']!r} "
                "disagree"
            )
        sampling["temperature"] = ("do_sample", 0.0)
    return _eos_ids(where, "eos_token_id", d.get("eos_token_id")), sampling


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
                sliding_window=8, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                draft_position_offset=0, draft_kv_settle="keep",
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
                sliding_window=64, num_experts=24, num_experts_per_tok=4,
                moe_intermediate_size=128, draft_position_offset=0, draft_kv_settle="keep",
            ),
        )
    raise ConfigError(f"preset: unknown preset {name!r}; choose one of {PRESETS}")


PRESETS = ("iquest-q1", "tiny", "mini")
