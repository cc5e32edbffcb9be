"""KV write / rollback kernels vs their twins (exact), and rolled-back caches vs caches that
never saw the rejected rows, over sequences that straddle every wrap point.

Dimension letters: C slots, R rows (kernel width 8), Hkv KV heads, D head dim.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.kv_cache import EMPTY, KVLayout, LayerKV, rollback, write_kv
from qualification.tolerances import check
from reference.twins.kv_cache import rollback_ref, write_ref

WIDTH = 8  # verification kernel width: rows written before reading
HKV, D = 2, 16

LAYOUTS = {
    "ring16+7": KVLayout.make_ring(16, 7, HKV, D),
    "draft8+7": KVLayout.make_ring(8, 7, HKV, D, start=1),
    "full96": KVLayout.make_full(96, HKV, D),
}


def _rows(gen: torch.Generator, device, width: int = WIDTH):
    k = torch.randn(width, HKV, D, generator=gen).to(torch.bfloat16).to(device)
    v = torch.randn(width, HKV, D, generator=gen).to(torch.bfloat16).to(device)
    return k, v


def _i32(x, device) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.int32, device=device)


def _assert_same(a: LayerKV, b: LayerKV) -> None:
    check(a.k, b.k, "kernels.kv_write", "bf16/int32")
    check(a.v, b.v, "kernels.kv_write", "bf16/int32")
    check(a.slot_pos, b.slot_pos, "kernels.kv_write", "bf16/int32")


def _needed(layout: KVLayout, n: int) -> range:
    """Committed positions a later read can still need: all of them for a full cache, the
    window of the next query (at position n) for a ring."""
    if layout.window is None or not layout.ring:
        return range(layout.start, n)
    return range(max(layout.start, n - layout.window + 1), n)


def _assert_like_never_rejected(cache: LayerKV, never: LayerKV, n: int, rolled: range) -> None:
    """Every position a later read can need is present with the never-rejected cache's label
    and data; every labelled slot tells the truth; rolled-back slots are EMPTY."""
    lay = cache.layout
    labels = cache.slot_pos.cpu()
    for p in _needed(lay, n):
        s = p % lay.capacity if lay.ring else p
        assert labels[s].item() == p, f"position {p}: slot {s} holds {labels[s].item()}"
        assert torch.equal(cache.k[s], never.k[s]) and torch.equal(cache.v[s], never.v[s]), p
    held = torch.nonzero(labels >= 0).flatten().tolist()
    for s in held:
        assert labels[s].item() < n, f"slot {s} still labelled with uncommitted {labels[s]}"
        assert labels[s].item() == never.slot_pos[s].item(), f"slot {s} label differs"
        assert torch.equal(cache.k[s], never.k[s]), f"slot {s} data differs"
    for p in rolled:
        s = p % lay.capacity if lay.ring else p
        if s < lay.capacity:
            assert labels[s].item() == EMPTY, f"rolled-back position {p}: slot {s} not EMPTY"


def _run_rounds(
    layout, n0, steps, seed, device, *, write=write_kv, roll=rollback, roll_ref=rollback_ref
):
    """Rounds of (write R of WIDTH rows, accept a ≤ R, roll back the rest), checked each step
    against the twins (exact) and against a cache that only ever saw accepted rows."""
    gen = torch.Generator().manual_seed(seed)
    cache = LayerKV.empty(layout, device)
    twin = LayerKV.empty(layout, device)
    never = LayerKV.empty(layout, device)
    n = max(n0, layout.start)
    for p0 in range(layout.start, n, WIDTH):  # committed history, written by the twin
        k, v = _rows(gen, device)
        pos = torch.arange(p0, p0 + WIDTH, dtype=torch.int32, device=device)
        for c in (cache, twin, never):
            write_ref(c, k, v, pos, min(WIDTH, n - p0))
    for r, a in steps:
        k, v = _rows(gen, device)
        pos = torch.arange(n, n + WIDTH, dtype=torch.int32, device=device)
        pos[r:] = -7 + 1000 * torch.arange(WIDTH - r, dtype=torch.int32)  # padding: garbage
        write(cache, k, v, pos, _i32(r, device))
        write_ref(twin, k, v, pos, r)
        _assert_same(cache, twin)
        write_ref(never, k, v, pos, a)
        roll(cache, _i32(n + a, device), _i32(n + r, device))
        roll_ref(twin, n + a, n + r)
        _assert_same(cache, twin)
        _assert_like_never_rejected(cache, never, n + a, range(n + a, n + r))
        n += a
    return n


_step = st.integers(1, WIDTH).flatmap(lambda r: st.tuples(st.just(r), st.integers(0, r)))


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(sorted(LAYOUTS)),
    n0=st.integers(0, 40),
    steps=st.lists(_step, min_size=4, max_size=14),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_random_rounds_match_twin_and_never_rejected(device, name, n0, steps, seed):
    layout = LAYOUTS[name]
    if not layout.ring:
        steps = steps[: (layout.capacity - n0 - WIDTH) // WIDTH]
    _run_rounds(layout, n0, steps, seed, device)


@pytest.mark.parametrize("name", ["ring16+7", "draft8+7"])
@pytest.mark.slow
def test_every_wrap_offset(device, name):
    """Blocks of 8 rows that wrap after j = 0 … 8 rows, each fully and partly rejected."""
    layout = LAYOUTS[name]
    c = layout.capacity
    for j in range(WIDTH + 1):
        for a in (0, 3, WIDTH):
            n0 = 2 * c - j
            _run_rounds(layout, n0 - 2 * WIDTH, [(WIDTH, WIDTH), (WIDTH, WIDTH), (WIDTH, a),
                                                (WIDTH, 1)], seed=31 * j + a, device=device)


def test_full_cache_rounds(device):
    _run_rounds(LAYOUTS["full96"], 3, [(8, 2), (5, 5), (8, 0), (8, 8), (1, 1), (8, 3)], 7, device)


# --- negative controls: each must fail the same checks --------------------------------------


def _skip_rollback(cache, keep, written):
    return None


def _never_evict(cache, k, v, pos, n_live):
    """Mutant: a ring written as if slots were positions (multi-token append never wraps)."""
    write_kv(dataclasses.replace(cache, layout=dataclasses.replace(cache.layout, ring=False)),
             k, v, pos, n_live)


@pytest.mark.parametrize(
    "mutant, symptom",
    [
        ("rollback skipped after wrap", "still labelled with uncommitted"),
        ("ring eviction skipped", "not bit-exact"),
        ("ring of exactly W slots", r"position \d+: slot \d+ holds"),
    ],
)
def test_negative_controls_fail(device, mutant, symptom):
    steps = [(8, 8), (8, 8), (8, 8), (8, 0), (8, 2), (8, 8)]  # crosses the wrap of 23 slots
    layout = LAYOUTS["ring16+7"]
    kw = {}
    if mutant == "rollback skipped after wrap":
        kw["roll"] = kw["roll_ref"] = _skip_rollback  # a runtime that forgets to roll back
    elif mutant == "ring eviction skipped":
        kw["write"] = _never_evict
    else:
        layout = KVLayout.make_ring(16, 0, HKV, D)
    _run_rounds(LAYOUTS["ring16+7"], 0, steps, 3, device)  # the production path passes
    with pytest.raises(AssertionError, match=symptom):
        _run_rounds(layout, 0, steps, 3, device, **kw)


def test_fused_qkv_views_and_bad_inputs(device):
    """k, v as strided views of a fused QKV output; wrong shapes/dtypes are named."""
    layout = LAYOUTS["ring16+7"]
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(WIDTH, 12 * D + 2 * HKV * D, generator=gen).to(torch.bfloat16).to(device)
    k = qkv[:, 12 * D : 12 * D + HKV * D].view(WIDTH, HKV, D)
    v = qkv[:, 12 * D + HKV * D :].view(WIDTH, HKV, D)
    pos = torch.arange(20, 20 + WIDTH, dtype=torch.int32, device=device)
    cache, twin = LayerKV.empty(layout, device), LayerKV.empty(layout, device)
    write_kv(cache, k, v, pos, _i32(6, device))
    write_ref(twin, k, v, pos, 6)
    _assert_same(cache, twin)
    with pytest.raises(ValueError, match="k must have R=8 rows"):
        write_kv(cache, k.float(), v, pos, 6)
    with pytest.raises(ValueError, match="positions must be int32"):
        write_kv(cache, k, v, pos.long(), 6)
    with pytest.raises(ValueError, match="n_live must be a 1-element int32"):
        write_kv(cache, k, v, pos, torch.tensor([6], device=device))
    with pytest.raises(ValueError, match="max_rows"):
        rollback(cache, 10, 30)
    with pytest.raises(ValueError, match="pad must be >= 0"):
        KVLayout.make_ring(16, -1, HKV, D)


@pytest.mark.gpu
def test_per_rank_ring_gpu():
    """The real sliding ring (4096 + 64, 1 KV head, D 128) through two wraps, vs the twins."""
    dev = torch.device("cuda")
    layout = KVLayout.make_ring(4096, 64, 1, 128)
    gen = torch.Generator().manual_seed(0)
    cache, twin = LayerKV.empty(layout, dev), LayerKV.empty(layout, dev)
    n = 2 * layout.capacity - 4
    for r, a in [(8, 3), (8, 8), (6, 0), (8, 5)]:
        k = torch.randn(WIDTH, 1, 128, generator=gen).to(torch.bfloat16).to(dev)
        pos = torch.arange(n, n + WIDTH, dtype=torch.int32, device=dev)
        write_kv(cache, k, -k, pos, _i32(r, dev))
        write_ref(twin, k, -k, pos, r)
        rollback(cache, _i32(n + a, dev), _i32(n + r, dev))
        rollback_ref(twin, n + a, n + r)
        _assert_same(cache, twin)
        n += a
