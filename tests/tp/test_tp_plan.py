"""iquestrt.tp.plan: every rank block holds channels of one checkpoint block (so its scale is
that block's), dequantized rank shards equal the checkpoint's channels bit for bit, the layout
round-trips, and the padded layout's byte overhead is what the module states (IQuest-Q1 experts
at TP8: +33 %)."""

from __future__ import annotations

import pytest
import torch

from iquestrt.tp.plan import (
    BLOCK,
    KINDS,
    overheads,
    padded,
    paired,
    rank_runs,
    shard_cols,
    shard_rows,
)
from reference import ops
from reference.config import ConfigError, preset

CASES = [("iquest-q1", 8), ("iquest-q1", 4), ("mini", 2), ("tiny", 2), ("tiny", 4)]


def test_iquest_experts_at_tp8_straddle_blocks():
    cfg = preset("iquest-q1")
    p = padded(rank_runs(cfg, 8, 1, "expert"))  # channels 192 … 383 of 1536
    assert [(r.start, r.stop, r.at) for r in p.runs] == [(192, 384, 64)]
    assert p.size == 256 and p.source_blocks() == [1, 2]
    assert overheads(cfg, 8)["expert"] == pytest.approx(1 / 3)
    assert overheads(cfg, 2)["expert"] == 0.0  # 768 per rank: whole blocks


@pytest.mark.parametrize("name, tp", CASES)
def test_every_rank_block_has_one_source_block(name, tp):
    cfg = preset(name)
    if name == "tiny" and tp == 4:
        with pytest.raises(ConfigError, match="num_key_value_heads"):
            rank_runs(cfg, tp, 0, "qkv")
        return
    for kind in KINDS:
        covered = []
        for r in range(tp):
            p = padded(rank_runs(cfg, tp, r, kind))
            blocks = p.source_blocks()  # raises if a rank block mixed two checkpoint blocks
            assert p.size % BLOCK == 0 and -1 not in blocks, (kind, r)
            covered += [i for run in p.runs for i in range(run.start, run.stop)]
        assert sorted(covered) == sorted(set(covered)), f"{kind}: ranks overlap"


def test_shards_dequantize_to_the_checkpoint_channels():
    """mini-like shapes at TP2: fc [E, 2I, H] rows (gate and up runs) and proj [E, H, I]
    columns; the rank's dequantized tensor, gathered, is the checkpoint's exactly."""
    cfg = preset("mini")
    g = torch.Generator().manual_seed(0)
    E, I, H = 3, cfg.target.moe_intermediate_size, cfg.target.hidden_size
    fc, fc_s = ops.quantize_block(torch.randn(E, 2 * I, H, generator=g))
    proj, proj_s = ops.quantize_block(torch.randn(E, H, I, generator=g))
    full_fc, full_proj = ops.dequant_block(fc, fc_s), ops.dequant_block(proj, proj_s)
    for r in range(2):
        rows = paired(rank_runs(cfg, 2, r, "expert_fc"))
        w, s = shard_rows(fc, fc_s, rows)
        got = rows.gather(ops.dequant_block(w, s).transpose(1, 2)).transpose(1, 2)
        want = torch.cat([full_fc[:, run.start : run.stop] for run in rows.runs], 1)
        assert torch.equal(got, want)
        cols = padded(rank_runs(cfg, 2, r, "expert"))
        w, s = shard_cols(proj, proj_s, cols)
        deq = ops.dequant_block(w, s)
        assert torch.equal(cols.gather(deq), full_proj[..., cols.runs[0].start : cols.runs[0].stop])
        assert (deq.abs().sum(-2) != 0).sum() == cols.dense * E  # zero columns outside the runs


def test_scatter_gather_round_trip_and_errors():
    p = padded([range(64, 128), range(200, 264)])
    x = torch.arange(2 * 128, dtype=torch.float32).reshape(2, 128)
    assert p.size == 384 and torch.equal(p.gather(p.scatter(x)), x)
    assert p.scatter(x)[:, :64].abs().sum() == 0
    with pytest.raises(ValueError, match="non-empty"):
        padded([range(5, 5)])
    with pytest.raises(ValueError, match="kind must be"):
        rank_runs(preset("mini"), 2, 0, "ffn")
    with pytest.raises(ValueError, match="rank 2 outside"):
        rank_runs(preset("mini"), 2, 2, "q")


@pytest.mark.parametrize("name, tp", [("iquest-q1", 8), ("mini", 2), ("tiny", 2)])
def test_gate_and_up_halves_share_the_down_projection_layout(name, tp):
    """Channel j of the gate half pairs with channel j of the up half, and both with input
    column j of the down projection: the halves' layouts equal the down plan's."""
    cfg = preset(name)
    for kind, down_kind in (("expert_fc", "expert"), ("dense_fc", "dense")):
        for r in range(tp):
            fc, down = paired(rank_runs(cfg, tp, r, kind)), padded(rank_runs(cfg, tp, r, down_kind))
            half = fc.size // 2
            assert half == down.size
            assert [x.at for x in fc.runs] == [down.runs[0].at, half + down.runs[0].at]
    with pytest.raises(ValueError, match="cannot share one layout"):
        paired([range(0, 64), range(100, 164)])  # 100..163 crosses a block at another offset
