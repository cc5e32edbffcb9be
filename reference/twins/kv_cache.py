"""Twins of kernels/kv_cache.py: the KV write and the rollback on a layer's cache, and the
rollback of several layers' caches (reference/kv_layout.py: the container both sides share).
The twins find a position's slot by their own arithmetic; the layout conventions, and why a
ring needs `pad ≥ R − 1`, are written down once in kernels/kv_cache.py.

Dimension letters: C slots, R rows, Hkv KV heads, D head dim.
"""

from __future__ import annotations

import torch

from reference.kv_layout import EMPTY, KVLayout, LayerKV


def _slot_ref(layout: KVLayout, p: int) -> int:
    return p % layout.capacity if layout.ring else p


def as_int(x) -> int:
    """A host int, or a one-element tensor (a device scalar) read as one."""
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def write_ref(cache: LayerKV, k: torch.Tensor, v: torch.Tensor, positions, n_live) -> None:
    """Store rows 0 … n_live−1 of k, v [R, Hkv, D] at their positions' slots, with labels; a
    row whose position is negative or has no slot (p ≥ C in a full cache) stores nothing."""
    for r in range(as_int(n_live)):
        p = as_int(positions[r])
        s = _slot_ref(cache.layout, p)
        if p < 0 or s >= cache.layout.capacity:
            continue
        cache.k[s] = k[r]
        cache.v[s] = v[r]
        cache.slot_pos[s] = p


def rollback_ref(cache: LayerKV, keep_until_position, written_until_position) -> None:
    """Label the slots of positions keep … written−1 EMPTY; data stays (never read again). A
    negative position, or one without a slot (p ≥ C in a full cache), is skipped."""
    for p in range(as_int(keep_until_position), as_int(written_until_position)):
        s = _slot_ref(cache.layout, p)
        if p >= 0 and s < cache.layout.capacity:
            cache.slot_pos[s] = EMPTY


def rollback_layers_ref(caches, keep_until_position, written_until_position) -> None:
    """rollback_ref of each cache with the same bounds."""
    for cache in caches:
        rollback_ref(cache, keep_until_position, written_until_position)
