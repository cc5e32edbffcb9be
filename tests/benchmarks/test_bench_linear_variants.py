"""bench_linear's --variant specs (benchmarks/launch_variant.py, shared with bench_moe): the
pinned LinearLaunch with the named fields changed; bad specs refused before any GPU work."""

from __future__ import annotations

import pytest

from benchmarks.bench_linear import main
from benchmarks.launch_variant import parse_variant
from kernels.linear_launch import linear_fp8_launch


def test_variant_changes_only_the_named_fields():
    pinned = linear_fp8_launch(1024, 3072)
    name, cfg = parse_variant("hoist_scales=1,num_stages=4", pinned)
    assert name == "hoist_scales=1,num_stages=4"
    assert (cfg.hoist_scales, cfg.num_stages) == (True, 4)
    assert (cfg.block_n, cfg.split_k) == (pinned.block_n, pinned.split_k)
    assert pinned.hoist_scales is False


@pytest.mark.parametrize("spec, words", [
    ("hoist=1", "'hoist=1' is not FIELD=VALUE"),
    ("num_stages=many", "num_stages takes an integer"),
    ("block_n=48", "LinearLaunch.block_n: expected a power of two"),
])
def test_bad_variant_is_refused_before_the_gpu(spec, words):
    with pytest.raises(SystemExit, match=words):
        main(["--variant", spec])
