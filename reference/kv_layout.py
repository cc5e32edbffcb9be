"""Per-layer KV cache layout (full cache or ring): the container the kernels and their twins
share (tensors and fields only, no slot arithmetic). The layout conventions, and why a ring
needs `pad ≥ R − 1`, are written down once in kernels/kv_cache.py; the twins that write, roll
back and read it: reference/twins/kv_cache.py and reference/twins/attention.py.

Dimension letters: C slots, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EMPTY = -1  # slot_pos label of a slot that holds no committed-or-pending position


@dataclass(frozen=True)
class KVLayout:
    capacity: int  # C: slots per layer
    kv_heads: int  # Hkv on this rank
    head_dim: int  # D
    window: int | None  # None: full attention; else keys t−W+1 … t (counts the query itself)
    ring: bool  # slot(p) = p mod C if True, slot(p) = p otherwise
    start: int = 0  # first position ever stored (0 target, 1 draft: position 0 has no entry)

    def __post_init__(self) -> None:
        where = "KVLayout"
        if self.capacity < 1 or self.kv_heads < 1 or self.head_dim < 1:
            raise ValueError(
                f"{where}: capacity, kv_heads, head_dim must be >= 1, got "
                f"{self.capacity}, {self.kv_heads}, {self.head_dim}"
            )
        if self.window is not None and self.window < 1:
            raise ValueError(f"{where}.window: must be >= 1 or None, got {self.window}")
        if self.ring and (self.window is None or self.capacity < self.window):
            raise ValueError(
                f"{where}: a ring needs a window and capacity >= window, got "
                f"capacity={self.capacity}, window={self.window}"
            )
        if self.start < 0:
            raise ValueError(f"{where}.start: must be >= 0, got {self.start}")

    @classmethod
    def make_ring(cls, window: int, pad: int, kv_heads: int, head_dim: int, start: int = 0):
        if pad < 0:
            raise ValueError(f"KVLayout.make_ring: pad must be >= 0, got {pad}")
        return cls(window + pad, kv_heads, head_dim, window, True, start)

    @classmethod
    def make_full(
        cls, capacity: int, kv_heads: int, head_dim: int, window: int | None = None, start: int = 0
    ):
        return cls(capacity, kv_heads, head_dim, window, False, start)


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache on one rank. Tensors are mutated in place by writes and rollbacks."""

    layout: KVLayout
    k: torch.Tensor  # [C, Hkv, D] bf16
    v: torch.Tensor  # [C, Hkv, D] bf16
    slot_pos: torch.Tensor  # [C] int32, position held by each slot, EMPTY (−1) if none

    @classmethod
    def empty(
        cls, layout: KVLayout, device=None, dtype: torch.dtype = torch.bfloat16
    ) -> LayerKV:
        shape = (layout.capacity, layout.kv_heads, layout.head_dim)
        return cls(
            layout,
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            torch.full((layout.capacity,), EMPTY, dtype=torch.int32, device=device),
        )

    def clone(self) -> LayerKV:
        return LayerKV(self.layout, self.k.clone(), self.v.clone(), self.slot_pos.clone())
