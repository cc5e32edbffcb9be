"""Trace mapping (benchmarks/rank/traces.py): counts kept, groups respected, determinism, the
mini model's cross-row correlation surviving the mapping onto 256 experts."""

import pytest
import torch

from benchmarks.rank.traces import (
    MODES,
    MiniTraces,
    distinct_per_layer,
    group_bounds,
    map_ids,
    record_mini_traces,
    trace_table,
    uniform_distinct,
    uniform_table,
)

E_MINI, K_MINI, E, K = 24, 4, 256, 8


def _mini_ids(t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(t, E_MINI, generator=g).topk(K_MINI, dim=1).indices  # [T, 4] distinct


@pytest.mark.parametrize("mode", MODES)
def test_each_mini_expert_becomes_two_experts_of_its_group(mode):
    mini = _mini_ids(200, 0)
    out = map_ids(mini, torch.arange(200), 7, E_MINI, E, K, seed=3, mode=mode)
    assert out.shape == (200, K) and out.dtype == torch.int64
    assert ((out >= 0) & (out < E)).all()
    assert all(len(set(row.tolist())) == K for row in out)  # a row's 8 ids are distinct
    owner = out * E_MINI // E  # the mini expert whose group holds each id
    for r in range(200):
        want = sorted(mini[r].tolist() * 2)  # every mini expert twice, nothing else
        assert sorted(owner[r].tolist()) == want
    first, size = group_bounds(E_MINI, E)
    assert int(size.sum()) == E and set(size.tolist()) == {10, 11}


def test_mapping_is_deterministic_and_seeded():
    mini, pos = _mini_ids(64, 1), torch.arange(64)
    a = map_ids(mini, pos, 5, E_MINI, E, K, seed=0)
    assert torch.equal(a, map_ids(mini, pos, 5, E_MINI, E, K, seed=0))
    assert not torch.equal(a, map_ids(mini, pos, 5, E_MINI, E, K, seed=1))
    assert not torch.equal(a, map_ids(mini, pos, 6, E_MINI, E, K, seed=0))  # layer in the hash


def test_primary_mode_shares_one_expert_per_mini_expert():
    mini = torch.tensor([[0, 1, 2, 3]] * 16)  # every row routes to the same mini experts
    pos = torch.arange(16)
    prim = map_ids(mini, pos, 1, E_MINI, E, K, 0, "primary").reshape(16, K_MINI, 2)
    posn = map_ids(mini, pos, 1, E_MINI, E, K, 0, "position").reshape(16, K_MINI, 2)
    assert (prim[:, :, 0] == prim[:1, :, 0]).all()  # the primary pick never changes
    assert len(set(prim[:, :, 1].flatten().tolist())) > K_MINI  # the second one moves
    assert len(set(posn[:, :, 0].flatten().tolist())) > K_MINI  # position mode: both move


def test_bad_mappings_are_refused():
    mini = _mini_ids(4, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        map_ids(mini, torch.arange(4), 1, E_MINI, E, 6, 0)
    with pytest.raises(ValueError, match="groups of 1"):
        map_ids(mini, torch.arange(4), 1, E_MINI, 32, K, 0)
    with pytest.raises(ValueError, match="mode"):
        map_ids(mini, torch.arange(4), 1, E_MINI, E, K, 0, "random")


def test_table_steps_are_windows_of_consecutive_positions():
    t = 40
    ids = tuple(_mini_ids(t, s) for s in range(3))  # 3 mini MoE layers
    tr = MiniTraces(ids, (0, 17), E_MINI, K_MINI, ("a", "b"))
    tab = trace_table(tr, moe_layers=6, rows=8, experts=E, top_k=K)
    assert tab.ids.shape == (2 + 2, 6, 8, K)  # prompt 0: 17 positions → 2 windows; prompt 1: 2
    # step 2 is prompt 1's first window (traced rows 17 … 24); rank layer 1 reads mini layer 0
    want = map_ids(ids[0], torch.cat([torch.arange(17), torch.arange(23)]), 1, E_MINI, E, K, 0)
    assert torch.equal(tab.ids[2, 0].long(), want[17:25])
    assert torch.equal(tab.ids[0, 5].long(), map_ids(
        ids[2], torch.cat([torch.arange(17), torch.arange(23)]), 6, E_MINI, E, K, 0)[0:8])


def test_distinct_counts():
    ids = torch.tensor([[[[0, 1], [1, 2], [5, 6]]]])  # [S=1, L=1, R=3, K=2]
    assert distinct_per_layer(ids, 1, 8).tolist() == [[2.0]]
    assert distinct_per_layer(ids, 2, 8).tolist() == [[3.0]]
    assert distinct_per_layer(ids, 3, 8).tolist() == [[5.0]]
    assert uniform_distinct(6, 256, 8) == pytest.approx(44.4, abs=0.05)  # 256·(1 − (31/32)^6)
    u = uniform_table(400, 4, 8, E, K, seed=0)
    assert distinct_per_layer(u.ids, 6, E).mean().item() == pytest.approx(44.4, rel=0.01)


@pytest.mark.slow
def test_real_traces_keep_the_cross_row_correlation():
    tr = record_mini_traces(prompts=4, max_tokens=160)
    expect = uniform_distinct(6, E, K)
    for mode in MODES:
        d = distinct_per_layer(trace_table(tr, 87, 8, E, K, 0, mode).ids, 6, E).mean().item()
        assert d < 0.96 * expect, (mode, d, expect)
    # the check can fail: routing that ignores the traces is not correlated
    u = uniform_table(200, 87, 8, E, K, seed=1)
    assert distinct_per_layer(u.ids, 6, E).mean().item() > 0.96 * expect
