"""Export trained weights as a servable checkpoint directory.

    <out>/checkpoint-bf16/   reference/checkpoint.py writer, format "bf16" (+ tokenizer.json)
    <out>/checkpoint/        E4M3 128x128 block FP8 made from the BF16 one by
                             reference.checkpoint.quantize_checkpoint — the path of
                             `iquestrt convert --quantize` — plus tokenizer.json and
                             training_report.json

Each directory is written under a temporary name and swapped in whole, so a re-export never
leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from reference.checkpoint import quantize_checkpoint, save_checkpoint
from reference.config import ModelConfig
from reference.params import BLOCK, all_specs

REPORT = "training_report.json"
TOKENIZER = "tokenizer.json"


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total parameters, and those one target token touches (top-k of E experts per layer)."""
    t, d = cfg.target, cfg.draft
    total = target_active = 0
    for name, spec in all_specs(cfg).items():
        n = math.prod(spec.shape)
        total += n
        if name.startswith("mtp.") or name.endswith("embed_tokens.weight"):
            continue
        share = t.num_experts_per_tok / t.num_experts if ".mlp.experts." in name else 1.0
        target_active += round(n * share)
    draft_experts = sum(
        math.prod(s.shape) for n, s in all_specs(cfg).items()
        if n.startswith("mtp.") and ".mlp.experts." in n
    )
    return {"total": total, "target_active_per_token": target_active,
            "draft_expert_params": draft_experts, "draft_top_k": d.num_experts_per_tok}


def _swap_in(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def export_checkpoint(
    out: Path, cfg: ModelConfig, params: dict[str, torch.Tensor], tokenizer: Path, report: dict
) -> Path:
    """Write both checkpoints and the report; returns the FP8 checkpoint directory."""
    out, tokenizer = Path(out), Path(tokenizer)
    if not tokenizer.is_file():
        raise FileNotFoundError(f"{tokenizer}: tokenizer JSON missing (pass --tokenizer)")
    bf16, fp8 = out / "checkpoint-bf16", out / "checkpoint"
    tmp_bf16, tmp_fp8 = out / ".checkpoint-bf16.tmp", out / ".checkpoint.tmp"
    for tmp in (tmp_bf16, tmp_fp8):
        if tmp.exists():
            shutil.rmtree(tmp)
    save_checkpoint(tmp_bf16, cfg, params, "bf16")
    quantize_checkpoint(tmp_bf16, tmp_fp8)
    for d in (tmp_bf16, tmp_fp8):
        shutil.copyfile(tokenizer, d / TOKENIZER)
    report = dict(report)
    report["checkpoint_bytes"] = directory_bytes(tmp_fp8)  # before the report itself
    report["e4m3_tensors"] = sum(s.kind == BLOCK for s in all_specs(cfg).values())
    text = json.dumps(report, indent=2, sort_keys=True) + "\n"
    (tmp_fp8 / REPORT).write_text(text)
    (out / REPORT).write_text(text)
    _swap_in(tmp_bf16, bf16)
    _swap_in(tmp_fp8, fp8)
    return fp8
