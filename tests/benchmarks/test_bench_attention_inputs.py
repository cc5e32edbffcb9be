"""The attention benchmarks' synthetic caches (benchmarks/bench_attention.py `_fill`, shared by
benchmarks/sweep_attention.py): a context past a full cache's capacity is refused by name before
any device work (without the refusal it is an out-of-bounds device assert on the H200:
reports/benchmarks/h200-2026-12-01/session10/README.md, call 1)."""

import pytest
import torch

from benchmarks.bench_attention import HKV, D, _fill
from kernels.kv_cache import KVLayout


def test_fill_labels_every_position_it_holds():
    gen = torch.Generator().manual_seed(0)
    full = _fill(KVLayout.make_full(64, HKV, D), 40, gen, "cpu")
    assert full.slot_pos[:40].tolist() == list(range(40))
    ring = _fill(KVLayout.make_ring(16, 8, HKV, D), 40, gen, "cpu")  # the last 24 positions
    assert sorted(ring.slot_pos.tolist()) == list(range(16, 40))


def test_fill_refuses_a_context_past_a_full_cache():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="full cache of 64 slots cannot hold positions up to 64"):
        _fill(KVLayout.make_full(64, HKV, D), 65, gen, "cpu")
