"""Deterministic synthetic weights whose scales keep activations healthy through every layer.

Scales (input rms ≈ 1 after each RMSNorm): projections N(0, 1/fan_in) so outputs have rms ≈ 1;
norm weights 1 + N(0, 0.05), except q/k-norm weights 1.5 + N(0, 0.05): with gain 1 the attention
logits have std ≈ 1 and deep layers attend almost uniformly (normalized entropy ≈ 0.97 on tiny),
so a wrong or missing key barely moves outputs; gain 1.5 gives std ≈ 2.25 and entropies
≈ 0.55–0.8 with some sharp rows; sink keys with rms 2 so the sink logit s is of the order of the
attention log-sum-exp L (the sink then matters); router logits with std ≈ 2 (routing neither
uniform nor collapsed); lm_head logits with std ≈ 3 (sampling has real entropy but is not flat).
`tests/reference/test_synthetic.py` checks these properties layer by layer.
"""

from __future__ import annotations

import torch

from reference.config import ModelConfig
from reference.params import all_specs

SINK_RMS = 2.0
ROUTER_STD = 2.0
QK_NORM_GAIN = 1.5
LOGIT_STD = 3.0


def _scale_for(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of the entries of one tensor."""
    fan_in = shape[-1]
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return QK_NORM_GAIN, 0.05
    if name.endswith("norm.weight"):
        return 1.0, 0.05
    if name.endswith("sink_k"):
        return 0.0, SINK_RMS
    if name.endswith("embed_tokens.weight"):
        return 0.0, 1.0
    if name.endswith("router.weight"):
        return 0.0, ROUTER_STD / fan_in**0.5
    if name.endswith("lm_head.weight"):
        return 0.0, LOGIT_STD / fan_in**0.5
    return 0.0, 1.0 / fan_in**0.5


def synthetic_params(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """All target and draft tensors (draft with prefix `mtp.`), FP32 values on the BF16 grid
    (routers: plain FP32), generated in name order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, spec in sorted(all_specs(cfg).items()):
        mean, std = _scale_for(name, spec.shape)
        t = torch.randn(spec.shape, generator=gen, dtype=torch.float32) * std + mean
        out[name] = t if spec.kind == "fp32" else t.to(torch.bfloat16).float()
    return out
