"""Shared helpers for the checkpoint tests: bitwise comparison, small configs, shard editing."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from reference.config import DraftConfig, ModelConfig, TargetConfig, layer_pattern

INDEX = "model.safetensors.index.json"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern (works for E4M3, where torch.equal is missing)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def odd_config(inter: int = 72, hidden: int = 160) -> ModelConfig:
    """4 layers, sizes not divisible by 128 (grids have partial edge blocks)."""
    return ModelConfig(
        name="odd",
        target=TargetConfig(
            vocab_size=300,
            hidden_size=hidden,
            layer_types=layer_pattern(0),
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=32,
            rotary_dim=8,
            sliding_window=16,
            intermediate_size=200,
            num_experts=3,
            num_experts_per_tok=2,
            moe_intermediate_size=inter,
            max_position_embeddings=1024,
        ),
        draft=DraftConfig(
            sliding_window=8, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=inter
        ),
    )


def files_bytes(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def read_index(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def edit_json(path: Path, fn: Callable[[dict], None]) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d, indent=2))


def edit_tensors(folder: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Apply fn to all tensors of one part and rewrite shards + index consistently (new names
    go to the first shard), so the only defect is the one fn introduces."""
    index = read_index(folder)
    wmap: dict[str, str] = index["weight_map"]
    files = sorted(set(wmap.values()))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(folder / f)))
    fn(tensors)
    placed = {n: wmap.get(n, files[0]) for n in tensors}
    for f in files:
        save_file({n: t.contiguous() for n, t in tensors.items() if placed[n] == f}, folder / f)
    index["weight_map"] = placed
    index["metadata"]["total_size"] = sum(t.nbytes for t in tensors.values())
    (folder / INDEX).write_text(json.dumps(index, indent=2))


def tree_digest(root: Path) -> str:
    """Every path and file byte under root (links as their target text)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()
