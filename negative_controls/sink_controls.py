"""Sink-key mutants, caught by gate 2 (stability bands): the candidate model's attention drops
the learned sink, or applies KV group g's sink key to group g + 1. The reference band is always
computed from the unmutated FP32/BF16 references.

On the synthetic tiny model, explicitly: gate 2 takes its verdict there. On the trained mini model
the unmutated candidate (bf16-fold) already fails the per-position band at a few positions
(qualification/stability.py says why), so the control's baseline would fail; the mutants
themselves move mini's logits by ~1.3e-2 relative RMS (median; tiny: ~1.0)."""

from __future__ import annotations

import torch

from negative_controls.control import Control
from qualification import stability
from reference.config import preset
from reference.model import ReferenceModel
from reference.synthetic import synthetic_params


def _mutate_sinks(params: dict, how: str) -> dict:
    out = dict(params)
    for name, t in params.items():
        if name.endswith("sink_k"):  # [Hkv, D]
            out[name] = torch.zeros_like(t) if how == "drop" else torch.roll(t, 1, dims=0)
    return out


def _gate(how: str):
    def run(mutated: bool):
        cfg = preset("tiny")
        params = synthetic_params(cfg, 0)
        fp32, bf16 = ReferenceModel(cfg, params, "fp32"), ReferenceModel(cfg, params, "bf16")
        cand = ReferenceModel(cfg, _mutate_sinks(params, how) if mutated else params, "bf16-fold")

        def logits(tokens):
            return cand.target(tokens, torch.arange(len(tokens)), cand.new_target_cache()).logits

        ok, _, evidence = stability.run(fp32, bf16, logits, stability.StabilityConfig(prompts=1))
        return ok, evidence

    return run


CONTROLS = (
    Control(
        "sink_dropped",
        "2 stability bands",
        "attention ignores the learned sink key (no O·sigmoid(L − s) correction)",
        _gate("drop"),
    ),
    Control(
        "sink_of_wrong_kv_group",
        "2 stability bands",
        "query heads of KV group g use the sink key of group g + 1",
        _gate("roll"),
    ),
)
