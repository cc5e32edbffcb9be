"""Expert prefetch in the runtime: before each sliding layer's attention, predict the experts of
the step from its incoming hidden state xn and warm their gate/up weights in L2
(kernels/prefetch.py). A cache hint only: routing still comes from the attention tail, the
kernels write only the prefetcher's own buffers, and switching it off changes no bit.

When it launches: enabled, the layer has a predictor (sliding layers), the backend is "kernels"
(the twins backend has no cache to warm, so it never launches there; the predicted set is
checked against its twin in tests/kernels/test_prefetch_kernel.py), and the live rows are in
[min_rows, max_rows] — decided on the host when it knows n, else by the kernels on the device
(a device-resident round: the programs return at once outside the range).
Called on the model's stream; each layer has its own buffers, so a later side stream needs
only an event per layer, no new allocations inside a captured graph.

Dimension letters: R rows (buffer), H hidden, E experts, M predicted experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from iquestrt.ops import Live
from iquestrt.weights import Weights
from kernels.prefetch import PrefetchBuffers, prefetch_experts
from reference.prefetch import load_predictors

PREDICTOR_DIR, PREDICTOR_FILE = "prefetch", "prefetch.safetensors"


def predictor_dir(checkpoint: str | Path) -> Path:
    """Predictors live in the checkpoint's prefetch/ folder (the checkpoint validator refuses
    stray .safetensors files beside the shards)."""
    return Path(checkpoint) / PREDICTOR_DIR


def has_predictors(checkpoint: str | Path) -> bool:
    """Whether the checkpoint ships predictors (one that is there but unreadable is refused)."""
    from reference.checkpoint_validate import optional_file

    return optional_file(checkpoint, predictor_dir(checkpoint) / PREDICTOR_FILE) is not None


@dataclass(frozen=True)
class PrefetchConfig:
    enabled: bool = True
    m: int = 0  # experts warmed per layer and step; 0: the predictor file's m
    min_rows: int = 4  # live verification rows that prefetch (the seed report: 4–5 pay off)
    max_rows: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.m, int) or self.m < 0:
            raise ValueError(f"PrefetchConfig.m: expected an int >= 0 (0: the file's), "
                             f"got {self.m!r}")
        if not 1 <= self.min_rows <= self.max_rows:
            raise ValueError(f"PrefetchConfig: expected 1 <= min_rows <= max_rows, got "
                             f"{self.min_rows}, {self.max_rows}")


class Prefetcher:
    def __init__(self, weights: Weights, predictors: dict[int, torch.Tensor], m: int,
                 cfg: PrefetchConfig, rows: int, launch: bool, pdl: bool = False):
        """predictors: {layer: P [H, E] BF16}; rows: the model's row buffer R; launch: run the
        kernels (False: maybe_prefetch never does anything); pdl: launch them with programmatic
        dependent launch (kernels/launch.py)."""
        t = weights.cfg.target
        moe = {layer.index: layer.moe for layer in weights.layers if layer.moe is not None}
        for i, p in predictors.items():
            if i not in moe:
                raise ValueError(f"prefetch: layer {i} has no MoE to prefetch for")
            if tuple(p.shape) != (t.hidden_size, t.num_experts):
                raise ValueError(f"prefetch: layer {i} predictor has shape {tuple(p.shape)}, "
                                 f"expected ({t.hidden_size}, {t.num_experts})")
        self.m = cfg.m or m
        if not 1 <= self.m <= t.num_experts:
            raise ValueError(f"prefetch: m = {self.m} outside [1, {t.num_experts}]")
        self.cfg, self.launch, self.pdl = cfg, launch and cfg.enabled, pdl
        self.p = {i: p.to(weights.device, torch.bfloat16).contiguous()
                  for i, p in predictors.items()}
        self.moe = {i: moe[i] for i in predictors}
        self.buffers = {}
        if self.launch:
            self.buffers = {i: PrefetchBuffers.create(rows, t.hidden_size, t.num_experts,
                                                      self.moe[i].fc.shape[1], self.m,
                                                      weights.device)
                            for i in predictors}

    @classmethod
    def load(cls, directory: str | Path, weights: Weights, cfg: PrefetchConfig, rows: int,
             ops_name: str, pdl: bool = False) -> Prefetcher:
        """The predictor file beside the checkpoint (reference/prefetch.py); launches only with
        the "kernels" backend."""
        preds, meta = load_predictors(predictor_dir(directory), weights.cfg)
        return cls(weights, preds, int(meta["m"]), cfg, rows, launch=ops_name == "kernels",
                   pdl=pdl)

    def maybe_prefetch(self, layer_index: int, xn: torch.Tensor, live: Live):
        """xn [R, H] bf16: the layer's attention input. → the layer's PrefetchBuffers when the
        kernels were launched, else None."""
        if not self.launch or layer_index not in self.p:
            return None
        c = self.cfg
        if live.known is not None and not c.min_rows <= live.known <= c.max_rows:
            return None
        m = self.moe[layer_index]
        return prefetch_experts(xn, live.t, self.p[layer_index], m.fc, m.fc_s, self.m,
                                c.min_rows, c.max_rows, buffers=self.buffers[layer_index],
                                pdl=self.pdl)
