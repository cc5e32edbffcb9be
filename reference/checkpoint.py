"""IQuest-Q1 checkpoints in the Hugging Face safetensors layout, BF16 or block-FP8.

    <dir>/config.json                          target config (ModelConfig.target_json)
    <dir>/model-0000i-of-0000n.safetensors     target tensors
    <dir>/model.safetensors.index.json         {"metadata": {"total_size", "format"}, "weight_map"}
    <dir>/mtp/config.json, shards, index       draft tensors, names WITHOUT the `mtp.` prefix

In memory (Checkpoint.tensors, the writer's params) draft names carry `mtp.`. What each format
stores, the per-expert naming accepted on load and every check are in checkpoint_validate.py.
The writer is deterministic: names sorted, shards filled greedily in name order, index JSON with
sorted keys, so equal params give byte-identical files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reference import config, ops
from reference.checkpoint_validate import (
    FORMATS,
    CheckpointError,
    Found,
    check_format,
    check_params,
    confined,
    expert_names,
    fuse_experts,
    logical_specs,
    moe_prefixes,
    stored_dtype,
    validate,
)
from reference.config import ConfigError, ModelConfig
from reference.params import BLOCK, DRAFT_PREFIX, SCALE_SUFFIX, all_specs
from reference.synthetic import synthetic_params

__all__ = [
    "FORMATS",
    "Checkpoint",
    "CheckpointError",
    "load_checkpoint",
    "make_synthetic_checkpoint",
    "quantize_checkpoint",
    "save_checkpoint",
]

INDEX = "model.safetensors.index.json"
MTP_DIR = "mtp"
DEFAULT_SHARD_BYTES = 64 << 20
_SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors")


@dataclass(frozen=True, eq=False)
class Checkpoint:
    cfg: ModelConfig
    fmt: str  # "bf16" | "fp8"
    tensors: dict[str, torch.Tensor]  # stored dtypes; fp8: E4M3 weights + FP32 `…_scale_inv`
    directory: Path

    def dequantized(self) -> dict[str, torch.Tensor]:
        """FP32 canonical params (block weights = E4M3 · scales in "fp8") for ReferenceModel."""
        out = {}
        for name, spec in all_specs(self.cfg).items():
            t = self.tensors[name]
            if spec.kind == BLOCK and self.fmt == "fp8":
                out[name] = ops.dequant_block(t, self.tensors[name + SCALE_SUFFIX])
            else:
                out[name] = t.float()
        return out


def _part_dirs(directory: Path) -> dict[str, Path]:
    """In-memory name prefix -> folder holding that part's shards and index."""
    return {"": directory, DRAFT_PREFIX: directory / MTP_DIR}


def _part_of(name: str) -> str:
    return DRAFT_PREFIX if name.startswith(DRAFT_PREFIX) else ""


# --- writer ------------------------------------------------------------------------------


def _split_experts(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(params)
    for prefix, (n_exp, inter, _) in moe_prefixes(cfg).items():
        fc, proj = out.pop(prefix + "fc"), out.pop(prefix + "proj")  # [E, 2I, H], [E, H, I]
        for e in range(n_exp):
            gate, up, down = expert_names(prefix, e)
            out[gate], out[up], out[down] = fc[e, :inter], fc[e, inter:], proj[e]
    return out


def _write_part(folder: Path, tensors: dict[str, torch.Tensor], fmt: str, max_bytes: int) -> None:
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(folder / file), metadata={"format": "pt"})
        weight_map.update((n, file) for n in names)
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"format": fmt, "total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def save_checkpoint(
    directory: str | Path,
    cfg: ModelConfig,
    params: dict[str, torch.Tensor],
    fmt: str = "bf16",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    per_expert: bool = False,
) -> None:
    """Write float `params` (canonical names, draft with `mtp.`) as a `fmt` checkpoint into a
    new or empty `directory`. "fp8" quantizes block tensors with ops.quantize_block;
    per_expert writes `…experts.{e}.gate_proj/up_proj/down_proj` instead of fused experts
    (in "fp8" each expert matrix is quantized on its own grid)."""
    check_format(fmt)
    if max_shard_bytes < 1:
        raise CheckpointError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise CheckpointError(f"{directory}: exists and is not an empty directory")
    check_params(cfg, params)
    layers = set(moe_prefixes(cfg)) if per_expert else set()
    floats = _split_experts(cfg, params) if per_expert else params
    parts: dict[str, dict[str, torch.Tensor]] = {p: {} for p in _part_dirs(directory)}
    for name, spec in logical_specs(cfg, layers).items():
        part = _part_of(name)
        disk, t = name[len(part) :], floats[name].detach()
        if spec.kind == BLOCK and fmt == "fp8":
            q, s = ops.quantize_block(t)
            parts[part][disk], parts[part][disk + SCALE_SUFFIX] = q, s
        else:
            parts[part][disk] = t.to(stored_dtype(spec.kind, fmt)).contiguous().clone()
    cfg.save(directory)
    for part, folder in _part_dirs(directory).items():
        _write_part(folder, parts[part], fmt, max_shard_bytes)


# --- reader ------------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out


def _read_index(folder: Path) -> tuple[str, int, dict[str, str]]:
    path = folder / INDEX
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        index = json.loads(path.read_text(), object_pairs_hook=_no_duplicates)
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from None
    meta = index.get("metadata") if isinstance(index, dict) else None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if set(index) != {"metadata", "weight_map"} or not isinstance(meta, dict):
        raise CheckpointError(f"{path}: must hold exactly 'metadata' and 'weight_map' objects")
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise CheckpointError(f"{path}: weight_map must map tensor names to shard file names")
    if set(meta) != {"format", "total_size"}:
        raise CheckpointError(f"{path}: metadata must hold exactly 'format' and 'total_size'")
    if meta["format"] not in FORMATS:
        raise CheckpointError(f"{path}: metadata.format {meta['format']!r} not in {FORMATS}")
    if not isinstance(meta["total_size"], int) or isinstance(meta["total_size"], bool):
        raise CheckpointError(f"{path}: metadata.total_size must be an integer")
    for name, file in sorted(wmap.items()):
        if not _SHARD_NAME.fullmatch(file):
            raise CheckpointError(f"{path}: tensor {name} maps to bad shard file name {file!r}")
    return meta["format"], meta["total_size"], wmap


def _read_part(folder: Path, root: Path) -> tuple[str, dict[str, tuple[Path, torch.Tensor]]]:
    """(format, disk name -> (shard, tensor)) with index and shards cross-checked; every file
    read lies inside `root`, the checkpoint folder."""
    confined(root, folder)
    confined(root, folder / INDEX)
    fmt, total_size, wmap = _read_index(folder)
    index = folder / INDEX
    listed = sorted(set(wmap.values()))
    for stray in sorted(p.name for p in folder.glob("*.safetensors")):
        if stray not in listed:
            raise CheckpointError(f"{folder / stray}: shard file not listed in {index}")
    out: dict[str, tuple[Path, torch.Tensor]] = {}
    first_of = {f: n for n, f in sorted(wmap.items(), reverse=True)}  # shard -> first tensor
    for file in listed:
        path = folder / file
        first = first_of[file]
        if not path.is_file():
            raise CheckpointError(f"{index}: shard {file} (holding {first}) is missing: {path}")
        confined(root, path)
        try:
            with safe_open(str(path), framework="pt") as sf:
                tensors = {k: sf.get_tensor(k) for k in sf.keys()}
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{path}: unreadable safetensors file: {e}") from None
        for name in sorted(tensors):
            if wmap.get(name) != file:
                where = "not in the index" if name not in wmap else f"indexed in {wmap[name]}"
                raise CheckpointError(f"{path}: tensor {name} is {where} ({index})")
            out[name] = (path, tensors[name])
    for name, file in sorted(wmap.items()):
        if name not in out:
            raise CheckpointError(f"{index}: tensor {name} is mapped to {file}, which lacks it")
    actual = sum(t.nbytes for _, t in out.values())
    if actual != total_size:
        raise CheckpointError(f"{index}: metadata.total_size={total_size}, tensors hold {actual}")
    return fmt, out


def _load_config(directory: Path) -> ModelConfig:
    try:
        return ModelConfig.load(directory)
    except (ConfigError, TypeError) as e:  # TypeError: a field of the wrong JSON type
        msg = str(e)
        if str(directory) not in msg:
            msg = f"{directory / 'config.json'} or mtp/config.json: {msg}"
        raise CheckpointError(msg) from None


def load_checkpoint(directory: str | Path) -> Checkpoint:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    for name in ("config.json", "mtp/config.json", "generation_config.json"):
        if (directory / name).exists():
            confined(directory, directory / name)
    cfg = _load_config(directory)
    fmts, found, index_of = {}, {}, {}
    for part, folder in _part_dirs(directory).items():
        fmts[part], tensors = _read_part(folder, directory)
        index_of[part] = folder / INDEX
        for disk, (path, t) in tensors.items():
            found[part + disk] = Found(path, disk, t)
    if fmts[""] != fmts[DRAFT_PREFIX]:
        raise CheckpointError(
            f"{index_of[DRAFT_PREFIX]}: format {fmts[DRAFT_PREFIX]!r} disagrees with "
            f"{index_of['']} format {fmts['']!r}"
        )
    fmt = fmts[""]
    per_expert = validate(directory, cfg, fmt, found, index_of, DRAFT_PREFIX)
    return Checkpoint(cfg, fmt, fuse_experts(cfg, fmt, found, per_expert), directory)


# --- conversions ---------------------------------------------------------------------------


def quantize_checkpoint(
    src_dir: str | Path, out_dir: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> None:
    """BF16 checkpoint -> E4M3 checkpoint with 128x128 inverse scales (fused expert naming)."""
    ck = load_checkpoint(src_dir)
    if ck.fmt != "bf16":
        raise CheckpointError(f"{Path(src_dir) / INDEX}: format is {ck.fmt!r}, expected 'bf16'")
    save_checkpoint(out_dir, ck.cfg, ck.dequantized(), "fp8", max_shard_bytes)


def make_synthetic_checkpoint(
    directory: str | Path, preset: str, seed: int, fmt: str = "fp8"
) -> ModelConfig:
    cfg = config.preset(preset)
    save_checkpoint(directory, cfg, synthetic_params(cfg, seed), fmt)
    return cfg
