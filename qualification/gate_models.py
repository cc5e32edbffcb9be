"""What qualify's gates run on: its configuration (QualifyConfig) and the references of the
model-based gates (GateModels) for `--model mini` (the shipped checkpoint, real prompts) or
`--model tiny` (synthetic weights, random tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from iquestrt import assets
from qualification import mini_engine
from reference.config import preset
from reference.model import ReferenceModel
from reference.synthetic import synthetic_params

MODELS = ("mini", "tiny")


@dataclass(frozen=True)
class QualifyConfig:
    quick: bool
    out: Path
    model: str = "mini"  # gates 0 and 1: the trained mini model (default) or the synthetic tiny
    weights_seed: int = 0  # tiny
    tokens_seed: int = 5  # tiny: gate 0's random prompt
    only: tuple[str, ...] = ()  # gate names (GATE_NAMES) to run; () = all
    jobs: int = 1  # gates side by side, each in its own process (qualification/gate_pool.py)
    gate_timeout_s: float = 1800.0  # jobs > 1: a gate running longer is killed and fails


@dataclass(frozen=True)
class GateModels:
    """The references of the model-based gates on one set of weights. Gate 0 verifies rows
    `prefix` … `prefix` + 7 of each prompt after a cached prefill of `prefix` tokens; prefix >
    the target window, so the verify rows' windows are clipped (and rings would wrap)."""

    name: str  # "mini" | "tiny"
    description: str  # the report's metadata
    refs: dict[str, ReferenceModel]  # "fp32", "bf16"
    params: dict[str, torch.Tensor]  # dequantized (mini) or synthetic (tiny) weights
    prompts: tuple[torch.Tensor, ...]  # [length + 8] each: gate 0 reads `length`, gate 2 all
    length: int
    prefix: int


def _tiny(q: QualifyConfig) -> GateModels:
    cfg = preset("tiny")
    params = synthetic_params(cfg, q.weights_seed)
    gen = torch.Generator().manual_seed(q.tokens_seed)
    toks = torch.randint(0, cfg.target.vocab_size, (48,), generator=gen)  # > window 16
    return GateModels("tiny", f"tiny synthetic, weights seed {q.weights_seed}",
                      {p: ReferenceModel(cfg, params, p) for p in ("fp32", "bf16")}, params,
                      (toks,), length=40, prefix=20)


def _mini() -> GateModels:
    ckpt = mini_engine.load_mini()
    params = ckpt.dequantized()
    length, prefix = 160, 140  # mini target window 128
    prompts = mini_engine.prompts(length + 8)  # one per request kind, real text
    where = mini_engine.MINI.relative_to(assets.root())
    desc = (f"mini ({where}, sha256 {mini_engine.checkpoint_digest()[:12]}); gate 0/1 prompts: "
            f"the last {length} (+8) tokens of {', '.join(p.id for p in prompts)}")
    refs = {p: ReferenceModel(ckpt.cfg, params, p) for p in ("fp32", "bf16")}
    return GateModels("mini", desc, refs, params, tuple(torch.tensor(p.ids) for p in prompts),
                      length=length, prefix=prefix)


def _models(q: QualifyConfig) -> GateModels:
    if q.model not in MODELS:
        raise ValueError(f"qualify: --model must be one of {MODELS}, got {q.model!r}")
    return _mini() if q.model == "mini" else _tiny(q)
