"""KV write / rollback kernels vs their twins (exact), and rolled-back caches vs caches that
never saw the rejected rows, over sequences that straddle every wrap point; the one-launch
rollback of several layers (rollback_layers) vs rollback_ref per layer.

Dimension letters: C slots, R rows (kernel width 8), Hkv KV heads, D head dim, L layers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.kv_cache import (
    EMPTY,
    KVLayout,
    LayerKV,
    LayerTable,
    rollback,
    rollback_layers,
    write_kv,
)
from qualification.tolerances import check
from reference.twins.kv_cache import rollback_layers_ref, rollback_ref, write_ref
from tests.kernels.sm90 import compile_sm90

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


# --- rollback_layers: every layer's rollback in one launch ---------------------------------

# a target's mix: rings (one the draft's, starting at 1) and full caches of two sizes
MIX = ("ring16+7", "full96", "draft8+7", "ring16+7", "full96")


def _mixed_caches(device, seed: int = 11, n: int = 60) -> list[LayerKV]:
    """Caches of MIX holding positions up to n − 1 (the rings wrapped twice or more)."""
    gen = torch.Generator().manual_seed(seed)
    caches = [LayerKV.empty(LAYOUTS[name], device) for name in MIX]
    for p0 in range(0, n, WIDTH):
        k, v = _rows(gen, device)
        pos = torch.arange(p0, p0 + WIDTH, dtype=torch.int32, device=device)
        for c in caches:
            write_ref(c, k, v, pos, min(WIDTH, n - p0))
    caches.append(LayerKV.empty(KVLayout.make_full(48, HKV, D), device))  # nothing written yet
    return caches


# (keep, written): 44 … 51 crosses the wrap of both rings (23 slots: at 46, 15 slots: at 45);
# 52 … 59 lies past the empty full cache's 48 slots
BOUNDS = ((52, 60), (44, 52), (58, 60), (57, 57), (0, 8), (40, 45))


@pytest.mark.parametrize("on_device", [True, False], ids=["device-scalars", "host-ints"])
def test_rollback_layers_equals_rollback_ref_per_layer(device, on_device):
    tables: dict = {}
    caches = _mixed_caches(device)
    start = [c.slot_pos.clone() for c in caches]
    for keep, written in BOUNDS:
        for c, labels in zip(caches, start, strict=True):  # in place: the same label addresses
            c.slot_pos.copy_(labels)
        twins = [c.clone() for c in caches]
        bounds = (_i32(keep, device), _i32(written, device)) if on_device else (keep, written)
        rollback_layers(caches, *bounds, tables=tables)
        for c in twins:
            rollback_ref(c, keep, written)
        for i, (c, t) in enumerate(zip(caches, twins, strict=True)):
            _assert_same(c, t)
            if written > keep and i < len(MIX):  # the empty full cache has nothing to relabel
                assert not torch.equal(c.slot_pos, start[i]), f"layer {i}: nothing relabelled"
    assert len(tables) == 1, "the table of one list of caches is built once"
    again = _mixed_caches(device)
    assert LayerTable.key(again) != next(iter(tables)), "other caches, another key"


def test_rollback_layers_twin_is_the_loop(device):
    caches = _mixed_caches(device)
    twins, loop = [c.clone() for c in caches], [c.clone() for c in caches]
    rollback_layers_ref(twins, 44, 52)
    for c in loop:
        rollback_ref(c, 44, 52)
    for a, b in zip(twins, loop, strict=True):
        _assert_same(a, b)
    assert rollback_layers.twin is rollback_layers_ref


@pytest.mark.parametrize("plant", ["capacity - 1", "ring flag cleared", "a layer's address twice"])
def test_rollback_layers_planted_table_is_caught(device, plant):
    """A table that lies about a layer (its capacity, its ring flag, whose labels) relabels
    the wrong slots: the comparison with rollback_ref per layer fails. (Every plant stays
    inside the label tensors: a lie that reached past one would write outside it.)"""
    caches = _mixed_caches(device)
    twins = [c.clone() for c in caches]
    good = LayerTable.of(caches)
    if plant == "capacity - 1":
        bad = dataclasses.replace(good, capacity=good.capacity - 1)
    elif plant == "ring flag cleared":
        bad = dataclasses.replace(good, ring=torch.zeros_like(good.ring))
    else:  # the draft ring's entry (15 slots) points at layer 0's labels (23 slots)
        bad = dataclasses.replace(good, labels=good.labels[[0, 1, 0, 3, 4, 5]])
    rollback_layers(caches, 44, 52, tables={LayerTable.key(caches): bad})
    for c in twins:
        rollback_ref(c, 44, 52)
    with pytest.raises(AssertionError, match="not bit-exact"):
        for c, t in zip(caches, twins, strict=True):
            _assert_same(c, t)


def test_rollback_layers_refuses_bad_arguments(device):
    caches = _mixed_caches(device)
    with pytest.raises(ValueError, match="caches must be a non-empty sequence of LayerKV"):
        rollback_layers([], 0, 1)
    with pytest.raises(ValueError, match="caches must be a non-empty sequence of LayerKV"):
        rollback_layers(caches[0], 0, 1)
    bad = dataclasses.replace(caches[1], slot_pos=caches[1].slot_pos.long())
    with pytest.raises(ValueError, match=r"caches\[1\]: cache.slot_pos must be int32"):
        rollback_layers([caches[0], bad], 0, 1)
    with pytest.raises(ValueError, match=r"caches\[0\]: cache must be a reference"):
        rollback_layers([caches[0].slot_pos], 0, 1)
    small = LayerKV.empty(KVLayout.make_full(4, HKV, D), device)
    with pytest.raises(ValueError, match=r"max_rows must be in \[1, capacity=4\]"):
        rollback_layers([caches[0], small], 0, 1)
    with pytest.raises(ValueError, match="written_until_position − keep_until_position"):
        rollback_layers(caches, 10, 30)
    with pytest.raises(ValueError, match="keep_until_position must be a 1-element int32"):
        rollback_layers(caches, torch.tensor([10], device=device), _i32(12, device))
    labels = [c.slot_pos.clone() for c in caches]
    assert all(torch.equal(c.slot_pos, t) for c, t in zip(caches, labels, strict=True))


def test_kernel_ops_roll_back_every_layer_in_one_launch_with_one_table(device, monkeypatch):
    from iquestrt.ops import KernelOps, TwinOps
    from kernels import kv_cache as KV

    ops = KernelOps(device, 1)
    launches = []
    real = KV._rollback_layers_kernel
    monkeypatch.setattr(KV, "_rollback_layers_kernel", _Grids(real, launches))
    caches, twins = _mixed_caches(device), _mixed_caches(device)
    for keep, written in BOUNDS[:3]:
        ops.rollback_layers(caches, _i32(keep, device), _i32(written, device))
        TwinOps(device, 1).rollback_layers(twins, keep, written)
    for c, t in zip(caches, twins, strict=True):
        _assert_same(c, t)
    assert launches == [(len(caches),)] * 3
    assert len(ops._layer_tables) == 1


class _Grids:
    """A kernel launched through [grid](…): records each grid, then launches."""

    def __init__(self, kernel, grids: list):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


_SM90_ROLLBACK_LAYERS = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import kv_cache as KV

sig = {"labels_ptr": "*i64", "cap_ptr": "*i32", "ring_ptr": "*i32", "keep_ptr": "*i32",
       "written_ptr": "*i32", "BLOCK": "constexpr", "EMPTY_LABEL": "constexpr",
       "PDL": "constexpr"}
k = triton.compile(ASTSource(KV._rollback_layers_kernel, sig,
                             constexprs={"BLOCK": 8, "EMPTY_LABEL": -1, "PDL": False}),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
ptx = k.asm["ptx"]
print(json.dumps({"ld_u64": ptx.count("ld.global.u64") + ptx.count("ld.global.b64"),
                  "st": ptx.count("st.global")}))
"""


@pytest.mark.slow
def test_rollback_layers_compiles_for_sm90():
    """Without a GPU: the int64 → pointer cast of the label table compiles for sm_90 (the
    interpreter runs it above): one 64-bit address load, stores through it."""
    pytest.importorskip("triton.backends.nvidia")
    got = compile_sm90(_SM90_ROLLBACK_LAYERS)
    assert got["ld_u64"] >= 1 and got["st"] >= 1, got


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
