"""config.json / mtp/config.json / generation_config.json written with the public IQuest-Q1 config
names (the SGLang and vLLM integrations' config classes) load, mapped by their public meaning;
our own names keep loading to the same values; conflicts, unsupported settings and names that
are neither ours nor public are errors naming the file and the field. Expected values are
written out literally here, never derived from the loader."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from reference import config as config_module
from reference.checkpoint import CheckpointError, load_checkpoint, make_synthetic_checkpoint
from reference.config import FULL, SLIDING, ConfigError, ModelConfig, preset

ROOT = Path(__file__).resolve().parents[2]
MINI = ROOT / "models" / "mini"
DOC = ROOT / "docs" / "public_conventions.md"

F, S = "full_attention", "sliding_attention"

# The tiny preset's shapes (the tensors make_synthetic_checkpoint writes), spelled the way the
# public config classes save them. Shape-free values (RoPE bases, eps, scales, context, draft
# slots) differ from the preset's so that the test sees they come from these files.
PUBLIC_TARGET = {
    "architectures": ["IQuestQ1ForCausalLM"],
    "model_type": "iquest_q1",
    "dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "vocab_size": 512,
    "hidden_size": 128,
    "dense_intermediate_size": 256,
    "intermediate_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-05,
    "use_cache": True,
    "pad_token_id": 0,
    "bos_token_id": None,
    "eos_token_id": [5, 11],
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rotary_dim": 8,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 500000.0,
        "partial_rotary_factor": 0.25,
    },
    "no_rope_layers": [],
    "swa_rope_theta": 20000.0,
    "sliding_window": 16,
    "use_hybrid_layers": True,
    "use_sliding_window": True,
    "first_layers_types": [F],
    "hybrid_layers_types_block": [F, S, S, S],
    "num_hybrid_layers_block": 1,
    "last_layers_types": [F, F, F],
    "layer_types": [F, F, S, S, S, F, F, F],
    "hybrid_layer_pattern": [0, 0, 1, 1, 1, 0, 0, 0],
    "is_hybrid_swa": True,
    "mlp_only_layers": [0],
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_router_dtype": "fp32",
    "enable_sink_attention": True,
    "first_layer_attn_out_scale": 1.0,
    "first_layer_ffn_out_scale": 1.0,
    "attn_out_scale": 1.0,
    "ffn_out_scale": 0.5,
    "softmax_scale": None,
    "logit_scale": 1.0,
    "enable_lm_head_fp32": True,
    "num_mtp_layers": 2,
}
PUBLIC_DRAFT = {
    "architectures": ["IQuestQ1MTPRecursive"],
    "model_type": "iquest_q1_mtp_recursive",
    "target_config": {"hidden_size": 128, "vocab_size": 512, "num_hidden_layers": 8},
    "num_draft_slots": 5,
    "num_target_layers": 8,
    "sliding_window": 8,
    "swa_rope_theta": 30000.0,
    "fp32_residual_connection": True,
    "num_hidden_layers": 1,
    "hidden_size": 128,
    "vocab_size": 512,
    "intermediate_size": 64,
    "dense_intermediate_size": 256,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rotary_dim": 8,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_router_dtype": "fp32",
    "enable_sink_attention": True,
    "first_layer_attn_out_scale": 1.0,
    "first_layer_ffn_out_scale": 1.0,
    "attn_out_scale": 1.0,
    "ffn_out_scale": 0.5,
    "rope_theta": 500000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                        "partial_rotary_factor": 0.25},
    "layer_types": [S],
    "first_layers_types": [S],
    "hybrid_layers_types_block": [],
    "num_hybrid_layers_block": 0,
    "last_layers_types": [],
    "hybrid_layer_pattern": [1],
    "is_hybrid_swa": True,
    "use_hybrid_layers": True,
    "use_sliding_window": True,
    "mlp_only_layers": [],
    "no_rope_layers": [],
    "eos_token_id": [5, 11],
    "enable_lm_head_fp32": True,
    "dtype": "bfloat16",
}
PUBLIC_GENERATION = {
    "bos_token_id": None,
    "eos_token_id": [11, 2],
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 30,
    "top_p": 0.85,
    "transformers_version": "4.57.1",
}


def _write(directory: Path, target: dict, draft: dict, generation: dict | None) -> None:
    (directory / "config.json").write_text(json.dumps(target, indent=2))
    (directory / "mtp" / "config.json").write_text(json.dumps(draft, indent=2))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))


@pytest.fixture(scope="module")
def public_ckpt(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("public") / "ck"
    make_synthetic_checkpoint(directory, "tiny", seed=3, fmt="bf16")
    _write(directory, PUBLIC_TARGET, PUBLIC_DRAFT, PUBLIC_GENERATION)
    return directory


def test_public_checkpoint_loads_field_by_field(public_ckpt):
    ck = load_checkpoint(public_ckpt)
    t, d, s = ck.cfg.target, ck.cfg.draft, ck.cfg.sampling
    assert t.vocab_size == 512
    assert t.hidden_size == 128
    assert t.layer_types == (FULL, FULL, SLIDING, SLIDING, SLIDING, FULL, FULL, FULL)
    assert t.num_attention_heads == 12
    assert t.num_key_value_heads == 2
    assert t.head_dim == 32
    assert t.rotary_dim == 8
    assert t.rope_theta == 500000.0
    assert t.swa_rope_theta == 20000.0
    assert t.sliding_window == 16
    assert t.qk_norm is True
    assert t.attention_sink is True
    assert t.rms_norm_eps == 1e-05
    assert t.intermediate_size == 256  # public dense_intermediate_size
    assert t.moe_intermediate_size == 64  # public intermediate_size
    assert t.num_experts == 16
    assert t.num_experts_per_tok == 4
    assert t.attn_out_scale == 1.0
    assert t.ffn_out_scale == 0.5
    assert t.max_position_embeddings == 2048
    assert t.quantize_lm_head is False
    assert d.num_draft_slots == 5
    assert d.num_hidden_layers == 1
    assert d.sliding_window == 8
    assert d.swa_rope_theta == 30000.0
    assert d.fp32_residual_connection is True
    assert d.num_experts == 16
    assert d.num_experts_per_tok == 4
    assert d.moe_intermediate_size == 64
    # no public field names the draft conventions: the public integrations' are the default
    assert (d.draft_position_offset, d.draft_kv_settle) == (-1, "recompute")
    assert (s.temperature, s.top_k, s.top_p) == (0.6, 30, 0.85)  # generation_config.json
    assert ck.cfg.eos_token_ids == (5, 11, 2)  # config.json's, then generation_config.json's
    assert ck.cfg.name == "custom"
    # the tensors were checked against these shapes: dense layer 0 is 256 wide, experts 64
    assert tuple(ck.tensors["model.layers.0.mlp.gate_proj.weight"].shape) == (256, 128)
    assert tuple(ck.tensors["model.layers.1.mlp.experts.fc"].shape) == (16, 128, 128)
    assert tuple(ck.tensors["mtp.layer.mlp.experts.proj"].shape) == (16, 128, 64)


def test_public_intermediate_size_is_the_expert_width(public_ckpt, tmp_path):
    """Swapping the two public widths gives tensors the wrong shapes: intermediate_size is read
    as the expert width, not as our dense width."""
    ck = tmp_path / "ck"
    shutil.copytree(public_ckpt, ck)
    swapped = {**PUBLIC_TARGET, "intermediate_size": 256, "dense_intermediate_size": 64}
    _write(ck, swapped, {**PUBLIC_DRAFT}, None)
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.\d+\.mlp\.\S+ has shape"):
        load_checkpoint(ck)


def test_shipped_mini_loads_unchanged():
    before = {p: (MINI / p).read_bytes() for p in ("config.json", "mtp/config.json")}
    ck = load_checkpoint(MINI)
    t, d = ck.cfg.target, ck.cfg.draft
    assert ck.cfg == preset("mini")
    assert (t.intermediate_size, t.moe_intermediate_size, t.num_experts) == (512, 128, 24)
    assert (t.vocab_size, t.hidden_size, t.sliding_window, t.quantize_lm_head) == (
        8192, 128, 128, True)
    assert (d.sliding_window, d.moe_intermediate_size, d.num_experts) == (64, 128, 24)
    # how the mini was trained, named in its own mtp/config.json
    assert (d.draft_position_offset, d.draft_kv_settle) == (0, "keep")
    assert '"draft_kv_settle": "keep"' in before["mtp/config.json"].decode()
    assert ck.cfg.eos_token_ids == ()
    assert ck.cfg.name == "mini"
    assert {p: (MINI / p).read_bytes() for p in before} == before


def test_our_writer_reproduces_the_shipped_files(tmp_path):
    """Saving what was loaded writes the shipped bytes again (our names are still written)."""
    ModelConfig.load(MINI).save(tmp_path)
    for p in ("config.json", "mtp/config.json"):
        assert (tmp_path / p).read_bytes() == (MINI / p).read_bytes(), p


def _load(tmp_path: Path, target: dict, draft: dict, generation: dict | None = None):
    (tmp_path / "mtp").mkdir(exist_ok=True)
    _write(tmp_path, target, draft, generation)
    return ModelConfig.load(tmp_path)


def _edited(base: dict, **changes) -> dict:
    out = copy.deepcopy(base)
    for k, v in changes.items():
        if v is _DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


_DROP = object()
OURS_TINY_TARGET = preset("tiny").target_json()
OURS_TINY_DRAFT = preset("tiny").draft_json()


@pytest.mark.parametrize("file, target, draft, generation, names", [
    ("config.json", _edited(PUBLIC_TARGET, attention_sink=False), PUBLIC_DRAFT, None,
     ["'enable_sink_attention'=True", "'attention_sink'=False"]),
    ("config.json", _edited(OURS_TINY_TARGET, dense_intermediate_size=300), OURS_TINY_DRAFT, None,
     ["'intermediate_size (the dense width: the file names moe_intermediate_size)'=256",
      "'dense_intermediate_size'=300"]),
    ("config.json", _edited(PUBLIC_TARGET, moe_intermediate_size=32), PUBLIC_DRAFT, None,
     ["'dense_intermediate_size'=256",
      "'intermediate_size (the dense width: the file names moe_intermediate_size)'=64"]),
    ("config.json", _edited(PUBLIC_TARGET, layer_types=[F, F, F, S, S, F, F, F]), PUBLIC_DRAFT,
     None, ["'layer_types'", "first_layers_types/hybrid_layers_types_block"]),
    ("config.json", _edited(PUBLIC_TARGET, hybrid_layer_pattern=[0, 1, 1, 1, 0, 0, 0, 0]),
     PUBLIC_DRAFT, None, ["'layer_types'", "'hybrid_layer_pattern'"]),
    ("config.json", _edited(PUBLIC_TARGET, rope_theta=1e6), PUBLIC_DRAFT, None,
     ["'rope_theta'=1000000.0", "'rope_parameters.rope_theta'=500000.0"]),
    ("config.json", _edited(PUBLIC_TARGET, rotary_dim=16), PUBLIC_DRAFT, None,
     ["'rotary_dim'=16", "'rope_parameters.partial_rotary_factor*head_dim'=8"]),
    ("mtp/config.json", PUBLIC_TARGET, _edited(PUBLIC_DRAFT, moe_intermediate_size=32), None,
     ["'intermediate_size'=64", "'moe_intermediate_size'=32"]),
    ("", OURS_TINY_TARGET, OURS_TINY_DRAFT, {"top_k": 30},
     ["'config.json sampling_defaults.top_k'=20", "'generation_config.json top_k'=30"]),
])
def test_two_names_that_disagree_are_an_error_naming_both(
    tmp_path, file, target, draft, generation, names
):
    with pytest.raises(ConfigError, match="disagree") as e:
        _load(tmp_path, target, draft, generation)
    msg = str(e.value)
    assert f"{tmp_path}: {file}" in msg
    for n in names:
        assert n in msg, msg


def test_agreeing_names_load(tmp_path):
    # with our moe_intermediate_size in the file, intermediate_size is our dense width
    both = _edited(PUBLIC_TARGET, attention_sink=True, moe_intermediate_size=64,
                   intermediate_size=256,
                   layer_types=["full", "full", "sliding", "sliding", "sliding", "full",
                                "full", "full"])
    cfg = _load(tmp_path, both, _edited(PUBLIC_DRAFT, moe_intermediate_size=64))
    assert (cfg.target.intermediate_size, cfg.target.moe_intermediate_size) == (256, 64)
    assert cfg.target.attention_sink is True
    assert cfg.draft.moe_intermediate_size == 64


@pytest.mark.parametrize("file, target, draft, generation, field", [
    ("config.json", _edited(PUBLIC_TARGET, hidden_sise=128), PUBLIC_DRAFT, None, "hidden_sise"),
    ("config.json", _edited(OURS_TINY_TARGET, moe_layer_freq=1), OURS_TINY_DRAFT, None,
     "moe_layer_freq"),
    ("mtp/config.json", PUBLIC_TARGET, _edited(PUBLIC_DRAFT, num_nextn_predict_layers=1), None,
     "num_nextn_predict_layers"),
    ("generation_config.json", PUBLIC_TARGET, PUBLIC_DRAFT,
     {**PUBLIC_GENERATION, "repetition_penalty": 1.1}, "repetition_penalty"),
    ("config.json sampling_defaults", _edited(OURS_TINY_TARGET, sampling_defaults={"min_p": 0.1}),
     OURS_TINY_DRAFT, None, "min_p"),
])
def test_a_name_neither_ours_nor_public_is_an_error(
    tmp_path, file, target, draft, generation, field
):
    with pytest.raises(ConfigError, match=rf"{re.escape(file)}: unknown fields \['{field}'\]"):
        _load(tmp_path, target, draft, generation)


@pytest.mark.parametrize("file, target, draft, field", [
    ("config.json", _edited(PUBLIC_TARGET, moe_router_dtype="bf16"), PUBLIC_DRAFT,
     "moe_router_dtype"),
    ("config.json", _edited(PUBLIC_TARGET, mlp_only_layers=[0, 1]), PUBLIC_DRAFT,
     "mlp_only_layers"),
    ("config.json", _edited(PUBLIC_TARGET, first_layer_ffn_out_scale=0.5), PUBLIC_DRAFT,
     "first_layer_ffn_out_scale"),
    ("config.json", _edited(PUBLIC_TARGET, use_sliding_window=False), PUBLIC_DRAFT,
     "use_sliding_window"),
    ("config.json", _edited(PUBLIC_TARGET, tie_word_embeddings=True), PUBLIC_DRAFT,
     "tie_word_embeddings"),
    ("config.json", _edited(PUBLIC_TARGET, enable_lm_head_fp32=1), PUBLIC_DRAFT,
     "enable_lm_head_fp32"),
    ("config.json", _edited(PUBLIC_TARGET, model_type="llama"), PUBLIC_DRAFT, "model_type"),
    ("config.json", _edited(PUBLIC_TARGET, softmax_scale=0.1), PUBLIC_DRAFT, "softmax_scale"),
    ("config.json", _edited(PUBLIC_TARGET, rope_scaling={"type": "linear", "factor": 2.0}),
     PUBLIC_DRAFT, "rope_scaling"),
    ("config.json", _edited(PUBLIC_TARGET, rope_parameters={"rope_type": "yarn"}), PUBLIC_DRAFT,
     "rope_parameters.rope_type"),
    ("mtp/config.json", PUBLIC_TARGET, _edited(PUBLIC_DRAFT, model_type="iquest_q1"),
     "model_type"),
    ("mtp/config.json", PUBLIC_TARGET, _edited(PUBLIC_DRAFT, layer_types=[F]), "layer_types"),
])
def test_settings_this_runtime_does_not_implement_are_errors(tmp_path, file, target, draft, field):
    with pytest.raises(ConfigError, match=rf"{re.escape(file)}: field '{re.escape(field)}'"):
        _load(tmp_path, target, draft)


@pytest.mark.parametrize("draft, field", [
    (_edited(PUBLIC_DRAFT, hidden_size=64), "'hidden_size'=64"),
    (_edited(PUBLIC_DRAFT, num_target_layers=88), "'num_target_layers'=88"),
    (_edited(PUBLIC_DRAFT, target_config={"vocab_size": 1000}), "'target_config.vocab_size'=1000"),
    (_edited(PUBLIC_DRAFT, enable_sink_attention=False), "'enable_sink_attention'=False"),
    (_edited(PUBLIC_DRAFT, rope_parameters={"partial_rotary_factor": 0.5}),
     "'rope_parameters.partial_rotary_factor*head_dim'=16"),
])
def test_draft_copies_of_target_fields_must_match(tmp_path, draft, field):
    with pytest.raises(ConfigError, match="disagrees with config.json") as e:
        _load(tmp_path, PUBLIC_TARGET, draft)
    assert f"{tmp_path}: mtp/config.json: field {field}" in str(e.value)


@pytest.mark.parametrize("field, value, message", [
    ("draft_position_offset", 1, "must be 0 .* or -1"),
    ("draft_position_offset", "-1", "draft_position_offset"),
    ("draft_kv_settle", "rewrite", "must be one of recompute, keep"),
])
def test_draft_conventions_outside_their_values_are_errors(tmp_path, field, value, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, PUBLIC_TARGET, {**PUBLIC_DRAFT, field: value})


def test_public_pattern_defaults_fill_missing_parts(tmp_path):
    only_blocks = _edited(PUBLIC_TARGET, first_layers_types=_DROP, hybrid_layers_types_block=_DROP,
                          last_layers_types=_DROP, layer_types=_DROP, hybrid_layer_pattern=_DROP)
    cfg = _load(tmp_path, only_blocks, PUBLIC_DRAFT)
    assert cfg.target.layer_types == ("full", "full", "sliding", "sliding", "sliding", "full",
                                      "full", "full")
    with pytest.raises(ConfigError, match=r"num_hidden_layers=8 disagrees with "
                                          r"len\(layer_types\)=88"):
        _load(tmp_path, _edited(only_blocks, num_hybrid_layers_block=_DROP), PUBLIC_DRAFT)


@pytest.mark.parametrize("value, expected", [
    (7, (7,)), ([7, 3, 7], (7, 3)), (None, ()), ([], ()),
])
def test_eos_token_id_forms(tmp_path, value, expected):
    cfg = _load(tmp_path, _edited(PUBLIC_TARGET, eos_token_id=value), PUBLIC_DRAFT)
    assert cfg.eos_token_ids == expected


@pytest.mark.parametrize("value", [True, "7", [1.5], {"id": 1}])
def test_eos_token_id_of_the_wrong_type_is_an_error(tmp_path, value):
    with pytest.raises(ConfigError, match=r"config\.json: field 'eos_token_id' must be an "
                                          r"integer or a list of integers"):
        _load(tmp_path, _edited(PUBLIC_TARGET, eos_token_id=value), PUBLIC_DRAFT)


def test_eos_token_id_outside_the_vocabulary_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^config\.eos_token_ids: \[512\] outside"):
        _load(tmp_path, _edited(PUBLIC_TARGET, eos_token_id=[1, 512]), PUBLIC_DRAFT)
    with pytest.raises(ConfigError, match=r"^config\.eos_token_ids: \[600\] outside"):
        _load(tmp_path, OURS_TINY_TARGET, OURS_TINY_DRAFT, {"eos_token_id": 600})


def test_eos_round_trips_through_our_writer(tmp_path):
    cfg = _load(tmp_path, PUBLIC_TARGET, PUBLIC_DRAFT, PUBLIC_GENERATION)
    out = tmp_path / "out"
    cfg.save(out)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [5, 11, 2]
    assert ModelConfig.load(out) == cfg


def test_do_sample_false_means_greedy(tmp_path):
    cfg = _load(tmp_path, PUBLIC_TARGET, PUBLIC_DRAFT, {"do_sample": False, "top_k": 5})
    assert (cfg.sampling.temperature, cfg.sampling.top_k, cfg.sampling.top_p) == (0.0, 5, 0.95)
    with pytest.raises(ConfigError, match=r"generation_config\.json: 'do_sample'=false"):
        _load(tmp_path, PUBLIC_TARGET, PUBLIC_DRAFT, {"do_sample": False, "temperature": 0.7})


def test_generation_config_json_must_be_an_object(tmp_path):
    (tmp_path / "mtp").mkdir()
    _write(tmp_path, PUBLIC_TARGET, PUBLIC_DRAFT, None)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"generation_config\.json: must hold a JSON object"):
        ModelConfig.load(tmp_path)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ConfigError, match=r"generation_config\.json: invalid JSON"):
        ModelConfig.load(tmp_path)


def test_the_notes_list_every_accepted_public_name():
    """docs/public_conventions.md's table names each public field the loader accepts."""
    doc = DOC.read_text()
    named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)`", doc))
    tables = [
        config_module.TARGET_RENAMED, config_module.DRAFT_RENAMED,
        config_module.TARGET_READ, config_module.DRAFT_READ,
        config_module.TARGET_FIXED, config_module.DRAFT_FIXED,
        config_module.TARGET_UNUSED, config_module.DRAFT_UNUSED,
        config_module.GENERATION_UNUSED, config_module.GENERATION_SAMPLING,
    ]
    missing = sorted({k for table in tables for k in table} - named)
    assert not missing, f"{DOC.name} does not name {missing}"
