"""reference/config.py: presets, the IQuest-Q1 layer pattern and TP8 shapes written literally
from IQuest-Q1's published architecture, JSON round trip, and validation errors that name their
field."""

import dataclasses
import json
import math

import pytest

from reference.config import (
    FULL,
    PRESETS,
    SLIDING,
    ConfigError,
    ModelConfig,
    RankShapes,
    preset,
)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_validate(name):
    cfg = preset(name)
    assert cfg.name == name
    cfg.target.validate()
    cfg.draft.validate(cfg.target)
    cfg.sampling.validate(cfg.target.vocab_size)
    assert dataclasses.replace(cfg) == cfg  # re-running __post_init__ accepts it too


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match=r"preset: unknown preset 'huge'.*iquest-q1.*tiny"):
        preset("huge")


def test_tiny_is_small_but_complete():
    t, d = preset("tiny").target, preset("tiny").draft
    assert t.hidden_size <= 256 and t.num_hidden_layers <= 8 and t.vocab_size <= 4096
    assert FULL in t.layer_types[1:] and SLIDING in t.layer_types[1:]
    assert t.num_experts >= 16 and t.num_experts_per_tok >= 4
    assert d.num_experts >= 16 and d.num_experts_per_tok >= 4
    assert t.sliding_window <= 64 and d.sliding_window < t.sliding_window
    assert t.num_attention_heads > t.num_key_value_heads > 1  # GQA with several groups
    assert 0 < t.rotary_dim < t.head_dim  # partial RoPE


def test_iquest_q1_matches_architecture_md():
    cfg = preset("iquest-q1")
    t, d, s = cfg.target, cfg.draft, cfg.sampling
    assert t.num_hidden_layers == 88
    assert t.full_layers == (
        0, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73, 77, 81,
        85, 86, 87,
    )
    assert len(t.full_layers) == 25 and len(t.sliding_layers) == 63
    assert t.layer_types[2:5] == (SLIDING, SLIDING, SLIDING) and t.layer_types[84] == SLIDING
    assert (t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (
        3072, 48, 8, 128)
    assert (t.q_size, t.kv_size, t.q_per_kv) == (6144, 1024, 6)
    assert (t.vocab_size, t.max_position_embeddings, t.rms_norm_eps) == (160000, 524288, 1e-6)
    assert (t.rotary_dim, t.rope_theta, t.swa_rope_theta, t.sliding_window) == (
        32, 1e6, 1e4, 4096)
    assert (t.intermediate_size, t.num_experts, t.num_experts_per_tok) == (12288, 256, 8)
    assert t.moe_intermediate_size == 1536
    assert (t.attn_out_scale, t.ffn_out_scale) == (1.0, 0.53881590608)
    assert t.qk_norm and t.attention_sink
    assert (d.num_draft_slots, d.num_hidden_layers, d.sliding_window, d.swa_rope_theta) == (
        7, 1, 512, 1e4)
    assert d.fp32_residual_connection
    assert (d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size) == (256, 8, 1536)
    assert (s.temperature, s.top_k, s.top_p) == (1.0, 20, 0.95)


def test_per_rank_tp8_matches_architecture_md():
    r = preset("iquest-q1").per_rank(8)
    assert r == RankShapes(
        tp=8,
        q_heads=6,
        kv_heads=1,  # sink key [1, 128] per rank
        qkv_out=768 + 128 + 128,
        o_in=768,
        expert_intermediate=192,  # gate+up [256, 384, 3072], down [256, 3072, 192]
        dense_intermediate=1536,  # layer 0: 3072 → 2 × 1536, 1536 → 3072
        vocab=20000,
        expert_bytes_fp8=3 * 3072 * 192,
    )
    assert math.isclose(r.expert_bytes_fp8 / 1e6, 1.77, abs_tol=0.005)


@pytest.mark.parametrize("tp,field", [(0, "tp"), (3, "num_key_value_heads"),
                                      (16, "num_key_value_heads")])
def test_per_rank_rejects_bad_tp(tp, field):
    with pytest.raises(ConfigError, match=rf"^tp: .*{field if tp else 'must be >= 1'}"):
        preset("iquest-q1").per_rank(tp)


@pytest.mark.parametrize("name", PRESETS)
def test_json_round_trip(name, tmp_path):
    cfg = preset(name)
    cfg.save(tmp_path)
    assert ModelConfig.load(tmp_path) == cfg
    on_disk = json.loads((tmp_path / "config.json").read_text())
    n_layers = cfg.target.num_hidden_layers
    assert on_disk["num_hidden_layers"] == len(on_disk["layer_types"]) == n_layers
    assert json.loads((tmp_path / "mtp" / "config.json").read_text())["sliding_window"] == (
        cfg.draft.sliding_window)
    assert ModelConfig.from_json(cfg.target_json(), cfg.draft_json()) == cfg


def test_json_errors_name_the_problem(tmp_path):
    cfg = preset("tiny")
    with pytest.raises(ConfigError, match=r"config\.json: unknown fields \['hiden_size'\]"):
        ModelConfig.from_json({**cfg.target_json(), "hiden_size": 1}, cfg.draft_json())
    with pytest.raises(ConfigError, match=r"mtp/config\.json: unknown fields \['window'\]"):
        ModelConfig.from_json(cfg.target_json(), {**cfg.draft_json(), "window": 1})
    with pytest.raises(ConfigError, match=r"num_hidden_layers=9 disagrees"):
        ModelConfig.from_json({**cfg.target_json(), "num_hidden_layers": 9}, cfg.draft_json())
    with pytest.raises(ConfigError, match=r"config\.json: missing"):
        ModelConfig.load(tmp_path)
    cfg.save(tmp_path)
    (tmp_path / "mtp" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        ModelConfig.load(tmp_path)
    cfg.save(tmp_path)
    bad = {**cfg.target_json(), "rope_theta": -1.0}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"config\.rope_theta"):
        ModelConfig.load(tmp_path)


TARGET_BAD = [
    ("vocab_size", 1), ("hidden_size", 0), ("layer_types", ("full",) * 8),
    ("layer_types", ("full", "sliding")), ("num_attention_heads", 0),
    ("num_attention_heads", 13), ("num_key_value_heads", 0), ("head_dim", 31),
    ("rotary_dim", 0), ("rotary_dim", 7), ("rotary_dim", 34), ("rope_theta", 0.0),
    ("rope_theta", math.nan), ("swa_rope_theta", -1.0), ("sliding_window", 1),
    ("rms_norm_eps", 0.0), ("intermediate_size", 0), ("num_experts", 0),
    ("num_experts_per_tok", 0), ("num_experts_per_tok", 17), ("moe_intermediate_size", 0),
    ("attn_out_scale", math.inf), ("ffn_out_scale", math.nan),
    ("max_position_embeddings", 16),
]
DRAFT_BAD = [
    ("num_draft_slots", 0), ("num_draft_slots", 17), ("num_hidden_layers", 2),
    ("sliding_window", 0), ("sliding_window", 16), ("swa_rope_theta", 0.0),
    ("num_experts", 0), ("num_experts_per_tok", 0), ("num_experts_per_tok", 17),
    ("moe_intermediate_size", 0),
]
SAMPLING_BAD = [
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf),
    ("top_k", -1), ("top_k", 513), ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
]


@pytest.mark.parametrize(
    "part,field,value",
    [("target", f, v) for f, v in TARGET_BAD]
    + [("draft", f, v) for f, v in DRAFT_BAD]
    + [("sampling", f, v) for f, v in SAMPLING_BAD],
)
def test_validation_error_names_its_field(part, field, value):
    cfg = preset("tiny")  # target window 16, 16 experts, top-4, vocab 512
    prefix = {"target": "config", "draft": "draft", "sampling": "sampling"}[part]
    bad = dataclasses.replace(getattr(cfg, part), **{field: value})
    with pytest.raises(ConfigError, match=rf"^{prefix}\.{field}: "):
        dataclasses.replace(cfg, **{part: bad})


@pytest.mark.parametrize("ids, message", [
    ((1, 1), r"repeats an id: \(1, 1\)"),
    ((0, 512), r"\[512\] outside \[0, vocab_size=512\)"),
    ((-1,), r"\[-1\] outside"),
    ([1], r"must be a tuple of integers"),
    ((True,), r"must be a tuple of integers"),
    (("2",), r"must be a tuple of integers"),
])
def test_eos_token_ids_validation_names_the_field(ids, message):
    with pytest.raises(ConfigError, match=rf"^config\.eos_token_ids: {message}"):
        dataclasses.replace(preset("tiny"), eos_token_ids=ids)


def test_eos_token_ids_default_and_round_trip(tmp_path):
    assert preset("iquest-q1").eos_token_ids == ()
    assert "eos_token_id" not in preset("tiny").target_json()  # no stop: the key is not written
    cfg = dataclasses.replace(preset("tiny"), eos_token_ids=(3, 1))
    cfg.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == [3, 1]
    assert ModelConfig.load(tmp_path).eos_token_ids == (3, 1)
    assert ModelConfig.load(tmp_path) == cfg
