"""bench_moe's --variant specs: parsed into the pinned MoeLaunch with those fields changed; bad
specs refused before any GPU work, naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.bench_moe import main, parse_variant
from kernels.moe_launch import moe_launch


def test_variant_changes_only_the_named_fields():
    pinned = moe_launch(3072, 192)
    name, cfg = parse_variant("down_rows=1,silu_in_down=1,down_block_n=128", pinned)
    assert name == "down_rows=1,silu_in_down=1,down_block_n=128"
    assert (cfg.down_rows, cfg.silu_in_down, cfg.down_block_n) == (True, True, 128)
    assert cfg.gate_up_block_n == pinned.gate_up_block_n and cfg.fold_combine is False
    _, off = parse_variant("down_rows=0", cfg)
    assert off.down_rows is False


@pytest.mark.parametrize("spec, words", [
    ("down_row=1", "down_row=1' is not FIELD=VALUE"),
    ("down_rows", "'down_rows' is not FIELD=VALUE"),
    ("down_block_n=wide", "down_block_n takes an integer"),
    ("down_block_n=48", "power of two"),
    ("fold_combine=1,down_rows=1", "fold_combine and down_rows"),
])
def test_bad_variant_is_refused_before_the_gpu(spec, words):
    with pytest.raises(SystemExit, match=words):
        main(["--variant", spec])


def test_flipped_flags_switch_their_rival_off():
    """--fold-ab / --ab on a pinned launch with down_rows on: folding the combine turns
    down_rows off (both move launch 5) instead of failing; a rival named too is kept."""
    from benchmarks.bench_moe import flipped

    pinned = moe_launch(3072, 192)
    assert pinned.down_rows
    cfg = flipped(pinned, fold_silu=True, fold_combine=True)
    assert (cfg.fold_silu, cfg.fold_combine, cfg.down_rows, cfg.silu_in_down) == (
        True, True, False, False)
    assert flipped(pinned, down_rows=False) == dataclasses.replace(pinned, down_rows=False)
    with pytest.raises(ValueError, match="fold_combine and down_rows"):
        flipped(pinned, fold_combine=True, down_rows=True)
