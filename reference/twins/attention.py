"""Twin of kernels/attention/: per live row, reference ops.attention (FP32) over
exactly the keys that row is entitled to — gathered from the cache by position and *label
checked*, so a ring that lost history raises instead of silently answering — with the learned
sink key; rounded once.

Dimension letters: C slots, R rows, L keys a row is entitled to, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import torch

from reference import ops
from reference.kv_layout import KVLayout, LayerKV
from reference.twins.kv_cache import as_int


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
    for r in range(as_int(n_live)):
        p = as_int(q_pos[r])
        k, v, k_pos = gather_window(cache, p)
        o = ops.attention(
            q[r : r + 1].cpu(), k.cpu(), v.cpu(), torch.tensor([p]), k_pos, cache.layout.window,
            None if sink_k is None else sink_k.cpu(), scale, out_dtype=torch.float32,
        )  # [1, Hq, D] FP32
        out[r] = o[0].to(out.dtype).to(out.device)
    return out
