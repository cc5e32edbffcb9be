"""Checkpoint writer/reader: bit-exact round trips, sharding, per-expert naming, quantization,
determinism and ceil-div scale grids. Malformed checkpoints:
tests/reference/test_checkpoint_errors.py."""

from __future__ import annotations

import math
import re

import pytest
import torch
from safetensors import safe_open

from reference import ops
from reference.checkpoint import (
    CheckpointError,
    load_checkpoint,
    make_synthetic_checkpoint,
    quantize_checkpoint,
    save_checkpoint,
)
from reference.config import preset
from reference.model import ReferenceModel
from reference.params import BLOCK, DRAFT_PREFIX, FP32, SCALE_SUFFIX, all_specs
from reference.synthetic import synthetic_params
from tests.helpers.ckpt_helpers import INDEX, bits, files_bytes, odd_config, read_index, same

SEED = 7


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, synthetic_params(cfg, SEED)


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert same(a[name], b[name]), name


def test_round_trip_bf16(tiny, tmp_path):
    cfg, params = tiny
    save_checkpoint(tmp_path / "ck", cfg, params, "bf16")
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.cfg == cfg and ck.fmt == "bf16" and ck.directory == tmp_path / "ck"
    assert sorted(ck.tensors) == sorted(all_specs(cfg))
    for name, spec in all_specs(cfg).items():
        want = params[name] if spec.kind == FP32 else params[name].to(torch.bfloat16)
        assert same(ck.tensors[name], want), name
    # synthetic params lie on the BF16 grid, so dequantizing gives them back exactly
    _assert_same_tensors(ck.dequantized(), params)
    ReferenceModel(cfg, ck.dequantized())  # the reference accepts what the loader returns


def test_round_trip_fp8(tiny, tmp_path):
    cfg, params = tiny
    save_checkpoint(tmp_path / "ck", cfg, params, "fp8")
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.cfg == cfg and ck.fmt == "fp8"
    deq = ck.dequantized()
    n_block = 0
    for name, spec in all_specs(cfg).items():
        if spec.kind == BLOCK:
            q, s = ops.quantize_block(params[name])
            assert same(ck.tensors[name], q) and same(ck.tensors[name + SCALE_SUFFIX], s), name
            assert same(deq[name], ops.dequant_block(q, s)), name
            n_block += 1
        else:
            dtype = torch.float32 if spec.kind == FP32 else torch.bfloat16
            assert same(ck.tensors[name], params[name].to(dtype)), name
            assert same(deq[name], params[name]), name
    assert n_block > 0 and len(ck.tensors) == len(all_specs(cfg)) + n_block
    # E4M3 is lossy: the dequantized weights are not the inputs (the comparison can fail)
    fc = "model.layers.1.mlp.experts.fc"
    assert not torch.equal(deq[fc], params[fc])


def test_multi_shard_and_index(tiny, tmp_path):
    cfg, params = tiny
    limit = 200 * 1024
    save_checkpoint(tmp_path / "one", cfg, params, "fp8")
    save_checkpoint(tmp_path / "many", cfg, params, "fp8", max_shard_bytes=limit)
    for folder in (tmp_path / "many", tmp_path / "many" / "mtp"):
        index = read_index(folder)
        wmap = index["weight_map"]
        files = sorted(set(wmap.values()))
        n = len(files)
        assert n > 2, folder
        assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        assert sorted(p.name for p in folder.glob("*.safetensors")) == files
        assert index["metadata"]["format"] == "fp8"
        total, in_order = 0, []
        for f in files:
            with safe_open(str(folder / f), framework="pt") as sf:
                keys = sorted(sf.keys())
                sizes = [sf.get_tensor(k).nbytes for k in keys]
            assert keys == sorted(k for k, v in wmap.items() if v == f), f
            assert sum(sizes) <= limit or len(keys) == 1, f
            total += sum(sizes)
            in_order += keys
        assert index["metadata"]["total_size"] == total
        assert in_order == sorted(wmap)  # shards are filled in name order
        assert not any(k.startswith(DRAFT_PREFIX) for k in wmap)
    _assert_same_tensors(
        load_checkpoint(tmp_path / "many").tensors, load_checkpoint(tmp_path / "one").tensors
    )


def _expert_names(folder) -> list[str]:
    return [k for k in read_index(folder)["weight_map"] if re.search(r"experts\.\d+\.", k)]


@pytest.mark.parametrize("fmt, inter", [("bf16", 64), ("bf16", 72), ("fp8", 128)])
def test_per_expert_loads_to_canonical(fmt, inter, tmp_path):
    cfg = preset("tiny") if inter == 64 else odd_config(inter=inter)
    params = synthetic_params(cfg, SEED)
    save_checkpoint(tmp_path / "fused", cfg, params, fmt)
    save_checkpoint(tmp_path / "split", cfg, params, fmt, per_expert=True)
    wmap = read_index(tmp_path / "split")["weight_map"]
    assert not any(k.endswith(("experts.fc", "experts.proj")) for k in wmap)
    n_exp = cfg.target.num_experts
    per_layer = 3 * n_exp * (2 if fmt == "fp8" else 1)
    n_moe = len(cfg.target.layer_types) - 1
    assert len(_expert_names(tmp_path / "split")) == n_moe * per_layer
    assert len(_expert_names(tmp_path / "split" / "mtp")) == per_layer
    if fmt == "fp8":  # each expert matrix has its own grid on disk
        g = "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"
        with safe_open(str(tmp_path / "split" / wmap[g]), framework="pt") as sf:
            grid = (inter // 128, math.ceil(cfg.target.hidden_size / 128))
            assert tuple(sf.get_tensor(g).shape) == grid
    _assert_same_tensors(
        load_checkpoint(tmp_path / "split").tensors, load_checkpoint(tmp_path / "fused").tensors
    )


def test_per_expert_fp8_unaligned_rejected(tiny, tmp_path):
    cfg, params = tiny  # expert intermediate 64: gate/up per-expert grids cannot stack into fc
    save_checkpoint(tmp_path / "ck", cfg, params, "fp8", per_expert=True)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "ck")
    msg = str(e.value)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in msg and ".safetensors" in msg
    assert "not a multiple of 128" in msg


def test_quantize_checkpoint_equals_fp8_save(tiny, tmp_path):
    cfg, params = tiny
    save_checkpoint(tmp_path / "bf16", cfg, params, "bf16", max_shard_bytes=1 << 20)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "q")
    save_checkpoint(tmp_path / "direct", cfg, params, "fp8")
    assert files_bytes(tmp_path / "q") == files_bytes(tmp_path / "direct")
    with pytest.raises(CheckpointError, match="expected 'bf16'"):
        quantize_checkpoint(tmp_path / "direct", tmp_path / "again")


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_writes_are_deterministic(tiny, fmt, tmp_path):
    cfg, params = tiny
    reordered = dict(reversed(list(params.items())))
    save_checkpoint(tmp_path / "a", cfg, params, fmt, max_shard_bytes=300 * 1024)
    save_checkpoint(tmp_path / "b", cfg, reordered, fmt, max_shard_bytes=300 * 1024)
    a, b = files_bytes(tmp_path / "a"), files_bytes(tmp_path / "b")
    assert len(a) > 6 and a == b
    # control: one flipped value changes the bytes
    flipped = dict(params)
    flipped["model.norm.weight"] = params["model.norm.weight"].neg()
    save_checkpoint(tmp_path / "c", cfg, flipped, fmt, max_shard_bytes=300 * 1024)
    assert files_bytes(tmp_path / "c") != a


def test_scale_grids_ceil_div(tmp_path):
    cfg = odd_config()  # hidden 160, expert intermediate 72, dense 200, qkv rows 224
    params = synthetic_params(cfg, SEED)
    save_checkpoint(tmp_path / "ck", cfg, params, "fp8")
    ck = load_checkpoint(tmp_path / "ck")
    grids = {}
    for name, spec in all_specs(cfg).items():
        if spec.kind != BLOCK:
            continue
        *lead, rows, cols = spec.shape
        grids[name] = tuple(ck.tensors[name + SCALE_SUFFIX].shape)
        assert grids[name] == (*lead, math.ceil(rows / 128), math.ceil(cols / 128)), name
    assert grids["model.layers.1.mlp.experts.fc"] == (3, 2, 2)  # [3, 144, 160]
    assert grids["mtp.layer.mlp.experts.proj"] == (3, 2, 1)  # [3, 160, 72]
    # the partial corner block of fc[2] scales by the amax of its valid 16x32 entries only
    fc = params["model.layers.1.mlp.experts.fc"]
    s = ck.tensors["model.layers.1.mlp.experts.fc" + SCALE_SUFFIX]
    assert torch.equal(s[2, 1, 1], fc[2, 128:144, 128:160].abs().max() / 448.0)
    deq = ck.dequantized()
    for name in grids:
        q, sc = ops.quantize_block(params[name])
        assert same(deq[name], ops.dequant_block(q, sc)), name


def test_make_synthetic_checkpoint(tmp_path):
    cfg = make_synthetic_checkpoint(tmp_path / "ck", "tiny", SEED)
    ck = load_checkpoint(tmp_path / "ck")
    assert cfg == preset("tiny") and ck.fmt == "fp8"
    assert torch.equal(bits(ck.tensors["model.norm.weight"]),
                       bits(synthetic_params(cfg, SEED)["model.norm.weight"].bfloat16()))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda p: p.pop("model.norm.weight"), "params: missing tensor model.norm.weight"),
        (lambda p: p.update(extra=torch.zeros(1)), "params: unknown tensor extra"),
        (lambda p: p.update({"lm_head.weight": torch.zeros(3, 3)}), "lm_head.weight has shape"),
        (lambda p: p["mtp.norm.weight"].__setitem__(0, math.nan), "mtp.norm.weight has NaN"),
        (lambda p: p.update({"model.norm.weight": torch.ones(128, dtype=torch.int32)}), "dtype"),
    ],
)
def test_writer_rejects_bad_params(tiny, tmp_path, edit, match):
    cfg, params = tiny
    params = {k: v.clone() for k, v in params.items()}
    edit(params)
    with pytest.raises(CheckpointError, match=match):
        save_checkpoint(tmp_path / "ck", cfg, params)
    assert not (tmp_path / "ck").exists()


def test_writer_rejects_bad_arguments(tiny, tmp_path):
    cfg, params = tiny
    with pytest.raises(CheckpointError, match="format 'fp16'"):
        save_checkpoint(tmp_path / "a", cfg, params, "fp16")
    with pytest.raises(CheckpointError, match="max_shard_bytes"):
        save_checkpoint(tmp_path / "b", cfg, params, max_shard_bytes=0)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / INDEX).write_text("{}")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        save_checkpoint(tmp_path / "c", cfg, params)
