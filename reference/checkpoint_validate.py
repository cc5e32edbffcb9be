"""What a checkpoint must hold, and the checks that enforce it (used by reference/checkpoint.py).

The stored layout follows from the config and the format: block tensors are BF16 ("bf16") or
E4M3 plus an FP32 inverse-scale grid `<name>_scale_inv` ("fp8"); routers are FP32 and the rest
BF16 in both. Fused experts `…mlp.experts.fc` [E, 2I, H] / `…mlp.experts.proj` [E, H, I] may
instead be stored per expert as `…mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H]
and `down_proj` [H, I], each with its own scale grid in "fp8"; loading fuses them.

Per-expert E4M3 gate/up are fused only when I % 128 == 0: then gate and up occupy whole
128-row blocks of `fc` and their grids stack exactly. Otherwise one block of `fc` would straddle
gate and up rows that were scaled independently, so the fused tensor cannot be expressed in
E4M3 with a 128x128 grid without re-quantizing (changing values). We reject such checkpoints
rather than silently re-quantize or mix dequantized tensors into an FP8 checkpoint; convert
the BF16 checkpoint with `quantize_checkpoint` instead.

Dimension letters: E experts, I expert intermediate, H hidden.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from reference.config import ModelConfig
from reference.params import BLOCK, FP8_BLOCK, FP32, SCALE_SUFFIX, ParamSpec, all_specs

FORMATS = ("bf16", "fp8")
E4M3 = torch.float8_e4m3fn
_PROJ = ("gate_proj", "up_proj", "down_proj")


class CheckpointError(ValueError):
    """A checkpoint (or the params given to the writer) is malformed; the message names the
    file and tensor."""


@dataclass(frozen=True)
class Stored:
    shape: tuple[int, ...]
    dtype: torch.dtype
    scale_of: str | None = None  # for an inverse-scale grid: the E4M3 weight it belongs to


@dataclass(frozen=True)
class Found:
    file: Path  # shard that holds the tensor
    disk_name: str  # name inside the shard (draft tensors without `mtp.`)
    tensor: torch.Tensor


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise CheckpointError(f"checkpoint format {fmt!r} is unknown; choose one of {FORMATS}")


def moe_prefixes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """`…mlp.experts.` -> (E, I, H) for every MoE layer, target and draft."""
    out = {}
    for name, spec in all_specs(cfg).items():
        if name.endswith("mlp.experts.fc"):
            e, two_i, h = spec.shape
            out[name[: -len("fc")]] = (e, two_i // 2, h)
    return out


def expert_names(prefix: str, e: int) -> tuple[str, str, str]:
    """(gate, up, down) per-expert names of expert e under `…mlp.experts.`."""
    return tuple(f"{prefix}{e}.{p}.weight" for p in _PROJ)  # type: ignore[return-value]


def logical_specs(cfg: ModelConfig, per_expert: set[str]) -> dict[str, ParamSpec]:
    """Canonical specs with the MoE layers in `per_expert` written per expert."""
    specs = all_specs(cfg)
    for prefix, (n_exp, inter, hidden) in moe_prefixes(cfg).items():
        if prefix not in per_expert:
            continue
        del specs[prefix + "fc"], specs[prefix + "proj"]
        for e in range(n_exp):
            gate, up, down = expert_names(prefix, e)
            specs[gate] = ParamSpec((inter, hidden), BLOCK)
            specs[up] = ParamSpec((inter, hidden), BLOCK)
            specs[down] = ParamSpec((hidden, inter), BLOCK)
    return specs


def stored_dtype(kind: str, fmt: str) -> torch.dtype:
    if kind == FP32:
        return torch.float32
    if kind == BLOCK and fmt == "fp8":
        return E4M3
    return torch.bfloat16


def stored_layout(cfg: ModelConfig, fmt: str, per_expert: set[str]) -> dict[str, Stored]:
    out: dict[str, Stored] = {}
    for name, spec in logical_specs(cfg, per_expert).items():
        out[name] = Stored(spec.shape, stored_dtype(spec.kind, fmt))
        if spec.kind == BLOCK and fmt == "fp8":
            out[name + SCALE_SUFFIX] = Stored(spec.scale_shape, torch.float32, scale_of=name)
    return out


def confined(root: Path, path: Path) -> Path:
    """`path`, refused when it (through symlinks) resolves outside the checkpoint folder."""
    real, base = Path(path).resolve(), Path(root).resolve()
    if real != base and base not in real.parents:
        raise CheckpointError(f"{path}: resolves to {real}, outside the checkpoint folder "
                              f"{base} (copy the file in instead of linking it)")
    return Path(path)


def optional_file(root: Path, path: Path) -> Path | None:
    """An optional file of a checkpoint (tokenizer, depth policy, prefetch predictor): None when
    there is no such entry; refused by name when there is one that cannot be read as a file (a
    folder, a dangling link or a link loop, a link leaving the checkpoint folder)."""
    path = Path(path)
    if not path.is_symlink() and not path.exists():
        return None
    try:
        confined(root, path)
    except (RuntimeError, OSError):  # a symlink loop (how resolve() says so varies by Python)
        raise CheckpointError(f"{path}: a symlink loop, not a readable file") from None
    if not path.is_file():
        what = "a folder" if path.is_dir() else "a dangling symlink or a symlink loop"
        raise CheckpointError(f"{path}: {what}, not a readable file")
    if not os.access(path, os.R_OK):
        raise CheckpointError(f"{path}: not readable (permissions)")
    return path


def stored_bytes(cfg: ModelConfig, fmt: str) -> int:
    """The tensor bytes of a `fmt` checkpoint of `cfg` (fused experts), before headers."""
    return sum(math.prod(st.shape) * st.dtype.itemsize
               for st in stored_layout(cfg, fmt, set()).values())


def detect_per_expert(cfg: ModelConfig, names: set[str]) -> set[str]:
    """MoE layers stored per expert: no fused `fc` and some `…mlp.experts.<digit>…` name."""
    out = set()
    for prefix in moe_prefixes(cfg):
        if prefix + "fc" in names:
            continue
        if any(n.startswith(prefix) and n[len(prefix) : len(prefix) + 1].isdigit() for n in names):
            out.add(prefix)
    return out


def _first_bad(bad: torch.Tensor) -> str:
    idx = tuple(int(i) for i in torch.nonzero(bad)[0])
    return f"{int(bad.sum())} entries, first at index {idx}"


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def non_finite(t: torch.Tensor) -> torch.Tensor:
    """Bool mask of NaN/Inf entries; E4M3 has no Inf and NaN is the bit pattern S.1111.111."""
    if t.dtype == E4M3:
        return (t.view(torch.uint8) & 0x7F) == 0x7F
    return ~torch.isfinite(t)


def check_params(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> None:
    """The writer's input: exactly the canonical names, right shapes, finite float values."""
    specs = all_specs(cfg)
    extra, missing = sorted(set(params) - set(specs)), sorted(set(specs) - set(params))
    if extra:
        raise CheckpointError(
            f"params: unknown tensor {extra[0]}{_more(extra)} (not in reference/params.py)"
        )
    if missing:
        raise CheckpointError(f"params: missing tensor {missing[0]}{_more(missing)}")
    for name in sorted(specs):
        t = params[name]
        if tuple(t.shape) != specs[name].shape:
            raise CheckpointError(
                f"params: tensor {name} has shape {list(t.shape)}, "
                f"expected {list(specs[name].shape)}"
            )
        if not t.is_floating_point() or t.dtype == E4M3:
            raise CheckpointError(f"params: tensor {name} has dtype {t.dtype}; pass float values")
        bad = non_finite(t)
        if bad.any():
            raise CheckpointError(f"params: tensor {name} has NaN/Inf: {_first_bad(bad)}")


def _config_files(directory: Path, name: str, draft_prefix: str) -> str:
    cfg_json = directory / "config.json"
    if name.startswith(draft_prefix):
        return f"{cfg_json} and {directory / 'mtp' / 'config.json'}"
    return str(cfg_json)


def validate(
    directory: Path,
    cfg: ModelConfig,
    fmt: str,
    found: dict[str, Found],
    index_of: dict[str, Path],  # in-memory name prefix ("" or "mtp.") -> its index file
    draft_prefix: str,
) -> set[str]:
    """Checks every tensor against the layout implied by config + format; returns the MoE
    prefixes stored per expert. `found` is keyed by in-memory name (draft with `mtp.`)."""
    per_expert = detect_per_expert(cfg, set(found))
    layout = stored_layout(cfg, fmt, per_expert)
    extra, missing = sorted(set(found) - set(layout)), sorted(set(layout) - set(found))
    if extra:
        f = found[extra[0]]
        raise CheckpointError(
            f"{f.file}: unknown tensor {f.disk_name}{_more(extra)}: not part of a checkpoint "
            f"of format {fmt!r} for {_config_files(directory, extra[0], draft_prefix)}"
        )
    if missing:
        name = missing[0]
        part = draft_prefix if name.startswith(draft_prefix) else ""
        disk = name[len(part) :]
        what = "tensor"
        if layout[name].scale_of is not None:
            what = f"scale (for E4M3 tensor {layout[name].scale_of[len(part):]})"
        raise CheckpointError(f"{index_of[part]}: missing {what} {disk}{_more(missing)}")
    for name in sorted(layout):
        _check_one(directory, name, layout[name], found, draft_prefix)
    return per_expert


def _check_one(
    directory: Path, name: str, want: Stored, found: dict[str, Found], draft_prefix: str
) -> None:
    f = found[name]
    t, where = f.tensor, f"{f.file}: tensor {f.disk_name}"
    if t.dtype != want.dtype:
        raise CheckpointError(f"{where} has dtype {t.dtype}, expected {want.dtype}")
    if tuple(t.shape) != want.shape:
        if want.scale_of is not None:
            w = found[want.scale_of].tensor
            raise CheckpointError(
                f"{where} has scale grid {list(t.shape)}, but its weight of shape "
                f"{list(w.shape)} needs ceil-div-by-{FP8_BLOCK} grid {list(want.shape)}"
            )
        raise CheckpointError(
            f"{where} has shape {list(t.shape)}, expected {list(want.shape)} from "
            f"{_config_files(directory, name, draft_prefix)}"
        )
    bad = non_finite(t)
    if bad.any():
        raise CheckpointError(f"{where} has NaN/Inf: {_first_bad(bad)}")
    if want.scale_of is not None and (t <= 0).any():
        raise CheckpointError(f"{where}: inverse scales must be > 0: {_first_bad(t <= 0)}")


def fuse_experts(
    cfg: ModelConfig, fmt: str, found: dict[str, Found], per_expert: set[str]
) -> dict[str, torch.Tensor]:
    """Validated tensors by in-memory name, per-expert layers fused into `fc` / `proj`."""
    out = {name: f.tensor for name, f in found.items()}
    fp8 = fmt == "fp8"
    for prefix, (n_exp, inter, _) in moe_prefixes(cfg).items():
        if prefix not in per_expert:
            continue
        if fp8 and inter % FP8_BLOCK:
            f = found[expert_names(prefix, 0)[0]]
            raise CheckpointError(
                f"{f.file}: tensor {f.disk_name}: per-expert E4M3 gate/up with "
                f"moe_intermediate_size={inter} (not a multiple of {FP8_BLOCK}) cannot be fused "
                f"into {prefix}fc without changing its {FP8_BLOCK}x{FP8_BLOCK} block grid; "
                "store fused experts or quantize the BF16 checkpoint with quantize_checkpoint"
            )
        suffixes = ("", SCALE_SUFFIX) if fp8 else ("",)
        for sfx in suffixes:
            gates, ups, downs = zip(
                *([out.pop(n + sfx) for n in expert_names(prefix, e)] for e in range(n_exp)),
                strict=True,
            )
            # gate rows first, then up: [E, 2I, H] (scales: [E, 2·I/128, ⌈H/128⌉])
            out[prefix + "fc" + sfx] = torch.stack(
                [torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)]
            )
            out[prefix + "proj" + sfx] = torch.stack(downs)  # [E, H, I]
    return out
