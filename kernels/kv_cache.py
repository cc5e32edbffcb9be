"""KV cache write and rollback kernels for full caches and rings (kernel family 8).

Conventions (the runtime follows them; reference/kv_layout.py holds the container and twins):

* One cache per layer and rank: K, V [C, Hkv, D] bf16 plus `slot_pos` [C] int32, the position
  each slot holds (−1 = empty). Labels are written by the KV-write kernel next to the data and
  are never used by attention's index arithmetic; qualification reads them to check which
  positions each row really attended.
* Full-attention layers: C = capacity (max positions), slot(p) = p.
* Sliding layers and the draft: a ring of C = W + pad slots, slot(p) = p mod C, where W counts
  the query itself (a query at t sees t−W+1 … t). Real config: 4096 + 64 (one 64-key tile);
  tiny preset: 16 + 8; draft: its window + pad.
* `start` is the first position ever stored (draft: 1, its position 0 has no entry); reads
  never go below it.

Why pad ≥ R − 1, where R = rows written before they are read (the verification width):
  with committed length n, one round writes positions n … n+R−1 and then reads. Writing
  position n+j overwrites the slot of position n+j−C, so after the writes the oldest surviving
  position is n+R−C. Row i (position n+i) needs n+i−W+1 … n+i; the most demanding is row 0,
  needing n−W+1. All windows are intact iff n+R−1−C < n−W+1, i.e. C ≥ W+R−1, i.e. pad ≥ R−1.
  (A ring of exactly W slots with R > 1 makes row 0 lose its R−1 oldest keys — the reference
  negative control.) It also follows that the positions a single read spans,
  [min_row − W + 1, max_row], number ≤ W + R − 1 ≤ C, so they map to distinct slots.
Why rollback after a rejected write is then safe:
  the runtime accepts a of the R rows and sets the committed length to n' = n + a ≥ n. The
  rejected writes overwrote positions ≤ n+R−1−C ≤ n+R−1−(W+R−1) = n−W ≤ n'−W, older than the
  window start n'−W+1 of any future query (queries are at positions ≥ n'). Positions n' …
  n+R−1 hold rejected data and are relabelled −1. A later read never sees it: a round writes
  its rows before reading, and attention's loads are masked to [min window start, max live row
  position] (not rounded to tiles), so every slot it loads holds a committed position or one
  this round rewrote. Hence later reads equal those of a cache that never saw the rejected
  rows. A full cache needs the same relabelling only (data beyond the committed length is
  never read).

Rows written in one call must map to distinct slots (R ≤ C); a long prefill writes only its
last C positions into a ring.

Writers: `write_kv` here, and kernels/qk_rope.py `qk_rope(cache=…)`, which stores the rows it
makes in the same launch (the runtime's path) with the same slots, labels and masking.
Rollback: `rollback` for one cache, `rollback_layers` for every target layer in one launch
(the same positions relabelled in each, through a device table of the layers' label addresses).

Dimension letters: C slots, R rows (kernel width), Hkv KV heads, D head dim, L layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import launch_opts, pdl_enter
from kernels.twin import twin
from reference.kv_layout import EMPTY, KVLayout, LayerKV
from reference.twins import kv_cache as _twins

__all__ = ["EMPTY", "KVLayout", "LayerKV", "LayerTable", "check_cache", "rollback",
           "rollback_layers", "write_kv"]


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, pos_ptr, n_live_ptr,  # k, v [R, Hkv, D]; positions [R] int32; n_live [1]
    ck_ptr, cv_ptr, label_ptr,  # cache K, V [C, Hkv, D]; slot_pos [C]
    C, HKV, D,
    s_kr, s_kh, s_vr, s_vh, s_cc, s_ch, s_vc, s_vch,
    RING: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    r = tl.program_id(0)
    n_live = tl.load(n_live_ptr)
    pos = tl.load(pos_ptr + r)
    if RING:
        slot = pos % C
    else:
        slot = pos
    # padding rows and out-of-range positions never touch memory
    live = (r < n_live) & (pos >= 0) & (slot < C)
    slot64 = slot.to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    m = live & (h < HKV) & (d < D)
    kv_k = tl.load(k_ptr + r * s_kr + h * s_kh + d, mask=m)
    kv_v = tl.load(v_ptr + r * s_vr + h * s_vh + d, mask=m)
    tl.store(ck_ptr + slot64 * s_cc + h * s_ch + d, kv_k, mask=m)
    tl.store(cv_ptr + slot64 * s_vc + h * s_vch + d, kv_v, mask=m)
    tl.store(label_ptr + slot64, pos, mask=live)


@triton.jit
def _rollback_kernel(
    label_ptr, keep_ptr, written_ptr, C,
    RING: tl.constexpr, BLOCK: tl.constexpr, EMPTY_LABEL: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    keep = tl.load(keep_ptr)
    written = tl.load(written_ptr)
    p = keep + tl.arange(0, BLOCK)  # positions keep … written−1 (≤ BLOCK of them)
    if RING:
        slot = p % C
    else:
        slot = p
    m = (p < written) & (p >= 0) & (slot < C)
    tl.store(label_ptr + slot, tl.full([BLOCK], EMPTY_LABEL, tl.int32), mask=m)


@triton.jit
def _rollback_layers_kernel(
    labels_ptr, cap_ptr, ring_ptr,  # per layer [L]: slot_pos address int64, C int32, ring int32
    keep_ptr, written_ptr,
    BLOCK: tl.constexpr, EMPTY_LABEL: tl.constexpr, PDL: tl.constexpr,
):
    """Program l: _rollback_kernel on layer l's labels."""
    pdl_enter(PDL)
    layer = tl.program_id(0)
    label_ptr = tl.load(labels_ptr + layer).to(tl.pointer_type(tl.int32), bitcast=True)
    c = tl.load(cap_ptr + layer)
    ring = tl.load(ring_ptr + layer) != 0
    keep = tl.load(keep_ptr)
    written = tl.load(written_ptr)
    p = keep + tl.arange(0, BLOCK)  # positions keep … written−1 (≤ BLOCK of them)
    slot = tl.where(ring, p % c, p)
    m = (p < written) & (p >= 0) & (slot < c)
    tl.store(label_ptr + slot, tl.full([BLOCK], EMPTY_LABEL, tl.int32), mask=m)


def _device_scalar(x, name: str, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.int32 or x.numel() != 1 or x.device != device:
            raise ValueError(
                f"kv_cache: {name} must be a 1-element int32 tensor on {device}, got "
                f"{x.dtype} shape {tuple(x.shape)} on {x.device}"
            )
        return x
    return torch.tensor([int(x)], dtype=torch.int32, device=device)


def check_cache(cache: LayerKV, where: str) -> None:
    """ValueError naming the tensor unless cache's K, V [C, Hkv, D] (contiguous last dim, one
    dtype) and slot_pos [C] int32 (unit stride) fit its layout."""
    if not isinstance(cache, LayerKV):
        raise ValueError(f"{where}: cache must be a reference.kv_layout.LayerKV, got "
                         f"{type(cache).__name__}")
    lay = cache.layout
    shape = (lay.capacity, lay.kv_heads, lay.head_dim)
    for name, t in (("k", cache.k), ("v", cache.v)):
        if tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(
                f"{where}: cache.{name} must be {shape} with a contiguous last dim, "
                f"got {tuple(t.shape)} strides {t.stride()}"
            )
    if cache.k.dtype != cache.v.dtype:
        raise ValueError(f"{where}: cache k/v dtypes differ ({cache.k.dtype}, {cache.v.dtype})")
    labels = cache.slot_pos
    if (labels.dtype != torch.int32 or tuple(labels.shape) != (lay.capacity,)
            or labels.stride(0) != 1):
        raise ValueError(
            f"{where}: cache.slot_pos must be int32 [{lay.capacity}] with unit stride, got "
            f"{labels.dtype} {tuple(labels.shape)} strides {labels.stride()}"
        )


@twin(_twins.write_ref)
def write_kv(
    cache: LayerKV,
    k: torch.Tensor,  # [R, Hkv, D], last dim contiguous (views of a fused QKV output are fine)
    v: torch.Tensor,  # [R, Hkv, D]
    positions: torch.Tensor,  # [R] int32 on the cache's device
    n_live,  # 1-element int32 device tensor (no host sync) or an int
    *,
    pdl: bool = False,
) -> None:
    """Store rows 0 … n_live−1 at slot(position) with their labels; padding rows untouched.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    where = "write_kv"
    check_cache(cache, where)
    lay, dev = cache.layout, cache.k.device
    r = k.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (lay.kv_heads, lay.head_dim):
            raise ValueError(
                f"{where}: {name} must be [R, {lay.kv_heads}, {lay.head_dim}], got {tuple(t.shape)}"
            )
        if t.shape[0] != r or t.stride(-1) != 1 or t.dtype != cache.k.dtype or t.device != dev:
            raise ValueError(
                f"{where}: {name} must have R={r} rows, a contiguous last dim, dtype "
                f"{cache.k.dtype} on {dev}; got {tuple(t.shape)} {t.stride()} {t.dtype} {t.device}"
            )
    if positions.dtype != torch.int32 or tuple(positions.shape) != (r,) or positions.device != dev:
        raise ValueError(
            f"{where}: positions must be int32 [{r}] on {dev}, got {positions.dtype} "
            f"{tuple(positions.shape)} on {positions.device}"
        )
    if r > lay.capacity:
        raise ValueError(f"{where}: {r} rows exceed the cache's {lay.capacity} slots")
    if r == 0:
        return
    n = _device_scalar(n_live, "n_live", dev)
    _write_kv_kernel[(r,)](
        k, v, positions, n, cache.k, cache.v, cache.slot_pos,
        lay.capacity, lay.kv_heads, lay.head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.v.stride(0), cache.v.stride(1),
        RING=lay.ring,
        BLOCK_H=triton.next_power_of_2(lay.kv_heads),
        BLOCK_D=triton.next_power_of_2(lay.head_dim),
        num_warps=1, **launch_opts(pdl),
    )


def _bounds(keep_until_position, written_until_position, max_rows: int, capacity: int, dev,
            where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The host checks of a rollback (max_rows in [1, capacity]; with host ints, at most
    max_rows positions) → keep, written as 1-element int32 tensors on dev."""
    if max_rows < 1 or max_rows > capacity:
        raise ValueError(
            f"{where}: max_rows must be in [1, capacity={capacity}], got {max_rows}"
        )
    bounds = (keep_until_position, written_until_position)
    if not any(isinstance(x, torch.Tensor) for x in bounds):
        keep, written = (int(x) for x in bounds)
        if not 0 <= written - keep <= max_rows:
            raise ValueError(
                f"{where}: written_until_position − keep_until_position must be in "
                f"[0, max_rows={max_rows}], got {written} − {keep}"
            )
    return (_device_scalar(keep_until_position, "keep_until_position", dev),
            _device_scalar(written_until_position, "written_until_position", dev))


@twin(_twins.rollback_ref)
def rollback(
    cache: LayerKV, keep_until_position, written_until_position, max_rows: int = 8, *,
    pdl: bool = False,
) -> None:
    """Relabel the slots of positions keep … written−1 EMPTY (see the module comment for why
    labels alone suffice). Positions may be 1-element int32 device tensors (no host sync) or
    ints; at most max_rows positions are rolled back (the kernel width). pdl: programmatic
    dependent launch (kernels/launch.py)."""
    where = "rollback"
    check_cache(cache, where)
    keep_t, written_t = _bounds(keep_until_position, written_until_position, max_rows,
                                cache.layout.capacity, cache.k.device, where)
    _rollback_kernel[(1,)](
        cache.slot_pos, keep_t, written_t, cache.layout.capacity,
        RING=cache.layout.ring, BLOCK=triton.next_power_of_2(max_rows), EMPTY_LABEL=EMPTY,
        num_warps=1, **launch_opts(pdl),
    )


@dataclass(frozen=True)
class LayerTable:
    """What _rollback_layers_kernel reads of L caches, on their device. The addresses never
    change for the caches' lifetime, so the table is built once per list of caches and a
    captured CUDA graph replays it like any other argument."""

    labels: torch.Tensor  # [L] int64: caches[l].slot_pos.data_ptr()
    capacity: torch.Tensor  # [L] int32: caches[l].layout.capacity
    ring: torch.Tensor  # [L] int32: 1 ring, 0 full cache

    @staticmethod
    def key(caches: Sequence[LayerKV]) -> tuple[tuple[int, int, bool], ...]:
        """(label address, capacity, ring) per cache: everything the table holds, so equal keys
        give equal tables."""
        return tuple((c.slot_pos.data_ptr(), c.layout.capacity, c.layout.ring) for c in caches)

    @classmethod
    def of(cls, caches: Sequence[LayerKV]) -> LayerTable:
        key = cls.key(caches)
        dev = caches[0].slot_pos.device
        return cls(torch.tensor([k[0] for k in key], dtype=torch.int64).to(dev),
                   torch.tensor([k[1] for k in key], dtype=torch.int32).to(dev),
                   torch.tensor([int(k[2]) for k in key], dtype=torch.int32).to(dev))


def _check_caches(caches, where: str) -> torch.device:
    """Every cache passes check_cache and lives on the first one's device → that device."""
    if isinstance(caches, LayerKV) or not isinstance(caches, Sequence) or not caches:
        raise ValueError(f"{where}: caches must be a non-empty sequence of LayerKV, got "
                         f"{type(caches).__name__}")
    for i, cache in enumerate(caches):
        check_cache(cache, f"{where}: caches[{i}]")
    dev = caches[0].k.device
    for i, cache in enumerate(caches):
        for name in ("k", "v", "slot_pos"):
            if getattr(cache, name).device != dev:
                raise ValueError(f"{where}: caches[{i}].{name} is on "
                                 f"{getattr(cache, name).device}, caches[0] on {dev}")
    return dev


@twin(_twins.rollback_layers_ref)
def rollback_layers(
    caches: Sequence[LayerKV], keep_until_position, written_until_position, max_rows: int = 8,
    *, tables: dict | None = None, pdl: bool = False,
) -> None:
    """rollback of every cache with the same bounds, in one launch (one program per cache).
    tables: {LayerTable.key(caches): LayerTable} kept by the caller across calls: the table
    is built on the first call for these caches and found there afterwards (None: built for
    this call). pdl: programmatic dependent launch (kernels/launch.py)."""
    where = "rollback_layers"
    dev = _check_caches(caches, where)
    keep_t, written_t = _bounds(keep_until_position, written_until_position, max_rows,
                                min(c.layout.capacity for c in caches), dev, where)
    key = LayerTable.key(caches)
    table = None if tables is None else tables.get(key)
    if table is None:
        table = LayerTable.of(caches)
        if tables is not None:
            tables[key] = table
    _rollback_layers_kernel[(len(caches),)](
        table.labels, table.capacity, table.ring, keep_t, written_t,
        BLOCK=triton.next_power_of_2(max_rows), EMPTY_LABEL=EMPTY,
        num_warps=1, **launch_opts(pdl),
    )
