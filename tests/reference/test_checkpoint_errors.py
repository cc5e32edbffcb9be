"""Every malformed checkpoint raises CheckpointError naming the file and tensor. Each case edits
a copy of a valid multi-shard checkpoint; the unedited copy (and a no-op rewrite) must load, so
each failure comes from the one defect introduced."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from reference.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from reference.config import preset
from reference.synthetic import synthetic_params
from tests.helpers.ckpt_helpers import INDEX, edit_json, edit_tensors, read_index

SHARD_BYTES = 1 << 20
NORM = "model.norm.weight"
QKV = "model.layers.1.self_attn.qkv_proj.weight"
ROUTER = "model.layers.2.mlp.router.weight"
EMBED = "model.embed_tokens.weight"
UP5 = "model.layers.3.mlp.experts.5.up_proj.weight"
BOGUS = "model.layers.0.bogus.weight"


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    cfg = preset("tiny")
    params = synthetic_params(cfg, 3)
    root = tmp_path_factory.mktemp("valid")
    for fmt in ("bf16", "fp8"):
        save_checkpoint(root / fmt, cfg, params, fmt, max_shard_bytes=SHARD_BYTES)
    save_checkpoint(root / "split", cfg, params, "bf16", SHARD_BYTES, per_expert=True)
    return root


def shard_of(ck: Path, name: str, part: str = "") -> str:
    return read_index(ck / part)["weight_map"][name]


def _set(name, fn):
    return lambda ts: ts.__setitem__(name, fn(ts[name]))


def _poke(name, index, value):
    def edit(ts):
        t = ts[name].clone()
        t[index] = value
        ts[name] = t
    return edit


def _nan_e4m3(t):
    t = t.clone()
    t.view(torch.uint8)[0, 0] = 0x7F
    return t


# (id, source, part, tensor edit | None, other edit(ck) | None, substrings; "@shard:NAME" is
# replaced by the file of tensor NAME in that part of the valid checkpoint)
CASES = [
    ("missing", "fp8", "", lambda ts: ts.pop(NORM), None,
     [f"{INDEX}: missing tensor {NORM}"]),
    ("missing_draft", "bf16", "mtp", lambda ts: ts.pop("layer.self_attn.sink_k"), None,
     [f"mtp/{INDEX}: missing tensor layer.self_attn.sink_k"]),
    ("missing_scale", "fp8", "", lambda ts: ts.pop(QKV + "_scale_inv"), None,
     [f"missing scale (for E4M3 tensor {QKV}) {QKV}_scale_inv", INDEX]),
    ("missing_expert", "split", "", lambda ts: ts.pop(UP5), None,
     [f"missing tensor {UP5}", INDEX]),
    ("extra", "fp8", "", lambda ts: ts.update({BOGUS: torch.zeros(2)}), None,
     [f"unknown tensor {BOGUS}", "@shard:lm_head.weight"]),
    ("scale_in_bf16", "bf16", "", lambda ts: ts.update({QKV + "_scale_inv": torch.ones(4, 1)}),
     None, [f"unknown tensor {QKV}_scale_inv", "@shard:lm_head.weight"]),
    ("mixed_expert_naming", "split", "",
     lambda ts: ts.update({"model.layers.4.mlp.experts.fc": torch.zeros(16, 128, 128)}), None,
     ["unknown tensor model.layers.4.mlp.experts.0.down_proj.weight"]),
    ("misshaped", "bf16", "", _set(NORM, lambda t: t[:-1]), None,
     [f"tensor {NORM} has shape [127]", "@shard:" + NORM, "expected [128] from", "config.json"]),
    ("misshaped_draft", "fp8", "mtp", _set("eh_proj.weight", lambda t: t.t().contiguous()), None,
     ["tensor eh_proj.weight has shape [256, 128]", "@shard:eh_proj.weight", "mtp/config.json"]),
    ("dtype_router", "fp8", "", _set(ROUTER, lambda t: t.bfloat16()), None,
     [f"tensor {ROUTER} has dtype torch.bfloat16, expected torch.float32", "@shard:" + ROUTER]),
    ("dtype_block", "fp8", "", _set(QKV, lambda t: t.float().bfloat16()), None,
     [f"tensor {QKV} has dtype torch.bfloat16, expected torch.float8_e4m3fn", "@shard:" + QKV]),
    ("nan_bf16", "bf16", "", _poke(EMBED, (3, 5), math.nan), None,
     [f"tensor {EMBED} has NaN/Inf: 1 entries, first at index (3, 5)", "@shard:" + EMBED]),
    ("inf_router", "fp8", "mtp", _poke("layer.mlp.router.weight", (1, 2), -math.inf), None,
     ["tensor layer.mlp.router.weight has NaN/Inf", "@shard:layer.mlp.router.weight"]),
    ("nan_e4m3", "fp8", "", _set(QKV, _nan_e4m3), None,
     [f"tensor {QKV} has NaN/Inf: 1 entries, first at index (0, 0)", "@shard:" + QKV]),
    ("nan_scale", "fp8", "", _poke(QKV + "_scale_inv", (1, 0), math.nan), None,
     [f"tensor {QKV}_scale_inv has NaN/Inf", "@shard:" + QKV + "_scale_inv"]),
    ("scale_zero", "fp8", "", _poke(QKV + "_scale_inv", (2, 0), 0.0), None,
     [f"tensor {QKV}_scale_inv: inverse scales must be > 0: 1 entries, first at index (2, 0)"]),
    ("scale_negative", "fp8", "mtp", _poke("layer.mlp.experts.fc_scale_inv", (3, 0, 0), -1.0),
     None, ["tensor layer.mlp.experts.fc_scale_inv: inverse scales must be > 0",
            "@shard:layer.mlp.experts.fc_scale_inv"]),
    ("scale_grid", "fp8", "", _set(QKV + "_scale_inv", lambda t: t[:-1]), None,
     [f"tensor {QKV}_scale_inv has scale grid [3, 1], but its weight of shape [512, 128] "
      "needs ceil-div-by-128 grid [4, 1]", "@shard:" + QKV + "_scale_inv"]),
]


def _rm_shard(ck):
    (ck / shard_of(ck, NORM)).unlink()


def _drop_index_entry(ck):
    edit_json(ck / INDEX, lambda d: d["weight_map"].pop(NORM))


def _ghost_index_entry(ck):
    edit_json(ck / INDEX, lambda d: d["weight_map"].update({"ghost.weight": shard_of(ck, NORM)}))


def _wrong_shard(ck):
    other = shard_of(ck, "lm_head.weight")
    assert other != shard_of(ck, NORM)
    edit_json(ck / INDEX, lambda d: d["weight_map"].update({NORM: other}))


def _stray_shard(ck):
    shutil.copy(ck / shard_of(ck, NORM), ck / "model-00009-of-00009.safetensors")


def _total_size(ck):
    def bump(d):
        d["metadata"]["total_size"] += 1
    edit_json(ck / INDEX, bump)


def _truncate_shard(ck):
    p = ck / shard_of(ck, NORM)
    p.write_bytes(p.read_bytes()[:100])


def _cfg(field, value, part="", **more):
    return lambda ck: edit_json(
        ck / part / "config.json", lambda d: d.update({field: value}, **more)
    )


def _duplicate_key(ck):
    text = (ck / INDEX).read_text().replace('"weight_map": {', f'"weight_map": {{"{NORM}": "x",', 1)
    (ck / INDEX).write_text(text)


CASES += [
    ("shard_missing", "fp8", "", None, _rm_shard,
     ["@shard:" + NORM, "(holding model.", "is missing", INDEX]),
    ("not_in_index", "fp8", "", None, _drop_index_entry,
     [f"tensor {NORM} is not in the index", "@shard:" + NORM]),
    ("index_lists_absent", "fp8", "", None, _ghost_index_entry,
     ["tensor ghost.weight is mapped to", "@shard:" + NORM, "which lacks it"]),
    ("wrong_shard", "bf16", "", None, _wrong_shard,
     [f"tensor {NORM} is indexed in", "@shard:lm_head.weight"]),
    ("stray_shard", "fp8", "", None, _stray_shard,
     ["model-00009-of-00009.safetensors: shard file not listed"]),
    ("total_size", "fp8", "", None, _total_size, [f"{INDEX}: metadata.total_size="]),
    ("unreadable_shard", "fp8", "", None, _truncate_shard,
     ["@shard:" + NORM, "unreadable safetensors"]),
    ("index_missing", "fp8", "", None, lambda ck: (ck / "mtp" / INDEX).unlink(),
     [f"mtp/{INDEX}: missing"]),
    ("index_bad_json", "fp8", "", None, lambda ck: (ck / INDEX).write_text("{"),
     [f"{INDEX}: invalid JSON"]),
    ("index_duplicate", "fp8", "", None, _duplicate_key, [f"duplicate key '{NORM}'"]),
    ("index_format", "fp8", "", None,
     lambda ck: edit_json(ck / INDEX, lambda d: d["metadata"].update(format="int4")),
     [f"{INDEX}: metadata.format 'int4'"]),
    ("format_disagrees", "fp8", "", None,
     lambda ck: edit_json(ck / "mtp" / INDEX, lambda d: d["metadata"].update(format="bf16")),
     [f"mtp/{INDEX}: format 'bf16' disagrees"]),
    ("config_hidden", "fp8", "", None, _cfg("hidden_size", 160),
     ["tensor lm_head.weight has shape [512, 128]", "@shard:lm_head.weight",
      "expected [512, 160] from", "config.json"]),
    ("config_vocab", "bf16", "", None, _cfg("vocab_size", 256),
     ["tensor lm_head.weight has shape [512, 128]", "expected [256, 128]"]),
    ("config_experts", "fp8", "", None, _cfg("num_experts", 8),
     ["tensor model.layers.1.mlp.experts.fc has shape [16, 128, 128]", "expected [8, 128, 128]",
      "@shard:model.layers.1.mlp.experts.fc"]),
    ("config_draft_experts", "fp8", "mtp", None, _cfg("num_experts", 8, "mtp"),
     ["tensor layer.mlp.experts.fc has shape [16, 128, 128]", "mtp/config.json",
      "@shard:layer.mlp.experts.fc"]),
    ("config_split_experts", "split", "", None, _cfg("num_experts", 8),
     ["unknown tensor model.layers.1.mlp.experts.10.down_proj.weight"]),
    ("config_layers", "bf16", "", None,
     _cfg("layer_types", ["full"] + ["full", "sliding", "sliding", "sliding"] * 2 + ["full"] * 3,
          num_hidden_layers=12),
     [f"{INDEX}: missing tensor model.layers.10.attention_norm.weight"]),
    ("config_missing", "fp8", "", None, lambda ck: (ck / "config.json").unlink(),
     ["config.json: missing"]),
    ("config_draft_missing", "fp8", "", None, lambda ck: (ck / "mtp" / "config.json").unlink(),
     ["mtp/config.json: missing"]),
    ("config_bad_json", "fp8", "", None, lambda ck: (ck / "config.json").write_text("{,"),
     ["invalid JSON"]),
    ("config_unknown_field", "fp8", "", None, _cfg("hidden_sise", 128),
     ["config.json: unknown fields ['hidden_sise']"]),
    ("config_wrong_type", "fp8", "", None, _cfg("hidden_size", "128"), ["config.json"]),
]


def _resolve(ck: Path, part: str, s: str) -> str:
    if s.startswith("@shard:"):
        return f"{part + '/' if part else ''}{shard_of(ck, s[len('@shard:'):], part)}"
    return s


@pytest.mark.parametrize("source, part, tensor_edit, other_edit, expect",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_checkpoint_raises(valid, tmp_path, source, part, tensor_edit, other_edit, expect):
    ck = tmp_path / "ck"
    shutil.copytree(valid / source, ck)
    wanted = [_resolve(ck, part, s) for s in expect]
    if tensor_edit is not None:
        edit_tensors(ck / part, tensor_edit)
    if other_edit is not None:
        other_edit(ck)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ck)
    msg = str(e.value)
    assert expect and all(w in msg for w in wanted), msg


@pytest.mark.parametrize("source", ["bf16", "fp8", "split"])
def test_unedited_and_noop_rewrite_load(valid, tmp_path, source):
    ck = tmp_path / "ck"
    shutil.copytree(valid / source, ck)
    load_checkpoint(ck)
    edit_tensors(ck, lambda ts: None)
    edit_tensors(ck / "mtp", lambda ts: None)
    load_checkpoint(ck)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "nowhere")
