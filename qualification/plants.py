"""Planted defects of known kind and size in an engine's op table, for measuring what gate 1
detects (qualification/gate1_power.py). The same plant works on the kernels and on the twins.

  quant_scale(size, layer)  the activation quantizer feeding one target layer's experts is off by
                            a relative `size`: its scales are × (1 + size) (kernels: the fused
                            producer's scales and x × (1 + size), which the twins quantize
                            themselves: the same dequantized values up to one rounding)
  no_sink()                 every attention call ignores the learned sink keys
  window(size)              every sliding-window attention sees `size` more keys (−1: the oldest
                            key of its window is dropped)

`planted(engine, plant)` puts the plant in front of the engine's ops for the block.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

KINDS = ("quant_scale", "no_sink", "window")


@dataclass(frozen=True)
class Plant:
    kind: str
    size: float = 0.0
    layer: int = 4  # quant_scale: the target layer whose expert input is mis-scaled

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Plant.kind: choose one of {KINDS}, got {self.kind!r}")
        if self.kind == "window" and (self.size != int(self.size) or self.size == 0):
            raise ValueError(f"Plant.size: a window plant moves whole slots, got {self.size}")

    @property
    def name(self) -> str:
        if self.kind == "quant_scale":
            return f"quant_scale {self.size:+.2%} L{self.layer}"
        if self.kind == "window":
            return f"window {int(self.size):+d}"
        return "no_sink"


class PlantedOps:
    """Delegates to `inner` but for the planted operation."""

    def __init__(self, inner, plant: Plant, moe_weights):
        self.inner, self.plant, self.moe_weights = inner, plant, moe_weights

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def moe(self, x, weights, ids, m, live, out_dtype, xq=None, out=None):
        if self.plant.kind == "quant_scale" and m is self.moe_weights:
            f = 1.0 + self.plant.size
            if xq is not None and xq[1] is not None:  # the kernels read these
                xq = (xq[0], xq[1] * f)
            x = (x.float() * f).to(x.dtype)  # the twins quantize x themselves
        return self.inner.moe(x, weights, ids, m, live, out_dtype, xq=xq, out=out)

    def _cache(self, cache):
        w = cache.layout.window
        if self.plant.kind != "window" or w is None or not cache.layout.ring:
            return cache
        return dataclasses.replace(cache, layout=dataclasses.replace(
            cache.layout, window=w + int(self.plant.size)))

    def _sink(self, sink_k):
        return None if self.plant.kind == "no_sink" else sink_k

    def attention(self, q, cache, positions, live, sink_k, scale):
        return self.inner.attention(q, self._cache(cache), positions, live, self._sink(sink_k),
                                    scale)

    def attention_q(self, q, cache, positions, live, sink_k, scale):
        return self.inner.attention_q(q, self._cache(cache), positions, live,
                                      self._sink(sink_k), scale)


@contextlib.contextmanager
def planted(engine, plant: Plant | None):
    """engine's target and draft run with `plant` (None: unchanged) for the block."""
    if plant is None:
        yield engine
        return
    layer = next((lay for lay in engine.w.layers if lay.index == plant.layer), None)
    if plant.kind == "quant_scale" and (layer is None or layer.moe is None):
        raise ValueError(f"Plant.layer: {plant.layer} is not an MoE layer of this model")
    real = engine.swap_ops(PlantedOps(engine.ops, plant,
                                      layer.moe if layer is not None else None))
    try:
        yield engine
    finally:
        engine.swap_ops(real)

