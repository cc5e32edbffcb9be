"""Sampling parameters with device-resident values (for graphs reused across requests).

top_k and greedy (temperature 0) fix the sampler's shapes and kernel variants: with the vocabulary
they are the "request shape" a captured CUDA graph is valid for. Temperature, top-p and the top-p
switch are read by the kernels from `values` at run time, so `update` (an in-place copy, ordered on
the stream) retargets a captured graph to another request of the same shape. The kernels read
exactly the fp32 values the scalar path passes: bits equal the SamplingDefaults path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.config import SamplingDefaults


def _row(params: SamplingDefaults) -> list[float]:
    # apply_top_p is decided on the host in double precision, as the scalar path does
    return [params.temperature or 1.0, params.top_p, float(params.top_p < 1.0)]


@dataclass(eq=False)
class DeviceSampling:
    top_k: int
    greedy: bool
    values: torch.Tensor  # [3] fp32: temperature (1 when greedy), top_p, apply_top_p (0 or 1)
    params: SamplingDefaults  # the parameters last written: the host-side twins sample with
    # these; kernels read `values`, never this

    @classmethod
    def create(cls, params: SamplingDefaults, vocab: int, device) -> DeviceSampling:
        if not isinstance(params, SamplingDefaults):
            raise ValueError(f"DeviceSampling: params must be a SamplingDefaults, got "
                             f"{type(params).__name__}")
        params.validate(vocab, where="params")
        return cls(params.top_k, params.temperature == 0.0,
                   torch.tensor(_row(params), dtype=torch.float32, device=device), params)

    def matches(self, params: SamplingDefaults) -> bool:
        """Same request shape: a graph captured with self serves params after `update`."""
        greedy = params.temperature == 0.0
        return greedy == self.greedy and (greedy or params.top_k == self.top_k)

    def update(self, params: SamplingDefaults, vocab: int) -> None:
        params.validate(vocab, where="params")
        if not self.matches(params):
            raise ValueError(
                f"DeviceSampling.update: params of another request shape (top_k {params.top_k}, "
                f"greedy {params.temperature == 0.0}) than this one's (top_k {self.top_k}, "
                f"greedy {self.greedy}): capture another graph")
        self.values.copy_(torch.tensor(_row(params), dtype=torch.float32), non_blocking=True)
        self.params = params
