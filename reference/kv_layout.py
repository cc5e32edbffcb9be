"""Per-layer KV cache layout (full cache or ring) and its plain-torch reference twins.

The layout conventions, and why a ring needs `pad ≥ R − 1`, are written down once in
kernels/kv_cache.py; this module holds the container both sides share (tensors and fields only,
no slot arithmetic) and the boring twins: `write_ref`, `rollback_ref`, `gather_window`,
`attention_ref`. The twins find a position's slot by their own arithmetic and then *check the
slot's label*, so a ring that lost history raises instead of silently answering.

Dimension letters: C slots, R rows, L keys a row is entitled to, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference import ops

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


def _slot_ref(layout: KVLayout, p: int) -> int:
    return p % layout.capacity if layout.ring else p


def _as_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def write_ref(cache: LayerKV, k: torch.Tensor, v: torch.Tensor, positions, n_live) -> None:
    """Store rows 0 … n_live−1 of k, v [R, Hkv, D] at their positions' slots, with labels."""
    for r in range(_as_int(n_live)):
        p = _as_int(positions[r])
        s = _slot_ref(cache.layout, p)
        cache.k[s] = k[r]
        cache.v[s] = v[r]
        cache.slot_pos[s] = p


def rollback_ref(cache: LayerKV, keep_until_position, written_until_position) -> None:
    """Label the slots of positions keep … written−1 EMPTY; data stays (never read again)."""
    for p in range(_as_int(keep_until_position), _as_int(written_until_position)):
        cache.slot_pos[_slot_ref(cache.layout, p)] = EMPTY


def window_positions(layout: KVLayout, position: int) -> range:
    """Positions a query at `position` is entitled to see (its own included)."""
    lo = layout.start if layout.window is None else max(layout.start, position - layout.window + 1)
    return range(lo, position + 1)


def gather_window(cache: LayerKV, position: int):
    """(k [L, Hkv, D], v [L, Hkv, D], k_pos [L]) for one query row, label-checked."""
    lay = cache.layout
    want = torch.arange(window_positions(lay, position).start, position + 1)  # [L]
    slots = want % lay.capacity if lay.ring else want
    if len(want) and slots.max().item() >= lay.capacity:
        raise ValueError(f"gather_window: position {position} beyond capacity {lay.capacity}")
    held = cache.slot_pos.cpu().long()[slots]  # [L]
    bad = torch.nonzero(held != want).flatten()
    if len(bad):
        i = bad[0].item()
        raise ValueError(
            f"gather_window: row at position {position} needs position {want[i].item()}, but "
            f"slot {slots[i].item()} holds {held[i].item()} (ring too small for the rows "
            f"written before reading, or a missing write)"
        )
    idx = slots.to(cache.k.device)
    return cache.k[idx], cache.v[idx], want


def attention_ref(
    q: torch.Tensor,  # [R, Hq, D] after q-norm and RoPE
    cache: LayerKV,
    q_pos: torch.Tensor,  # [R] int
    n_live,  # int or 1-element int tensor; rows >= n_live are padding
    sink_k: torch.Tensor | None,  # [Hkv, D]
    scale: float,
    out: torch.Tensor | None = None,  # [R, Hq, D]; padding rows are left as they are
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Twin of kernels.attention.attention: per live row, ops.attention (FP32) over exactly the
    keys gathered for it; rounded once to out_dtype."""
    if out is None:
        out = torch.full(q.shape, float("nan"), dtype=out_dtype, device=q.device)
    for r in range(_as_int(n_live)):
        p = _as_int(q_pos[r])
        k, v, k_pos = gather_window(cache, p)
        o = ops.attention(
            q[r : r + 1].cpu(), k.cpu(), v.cpu(), torch.tensor([p]), k_pos, cache.layout.window,
            None if sink_k is None else sink_k.cpu(), scale, out_dtype=torch.float32,
        )  # [1, Hq, D] FP32
        out[r] = o[0].to(out.dtype).to(out.device)
    return out
