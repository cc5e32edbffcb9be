"""bench_tails --ab: a flag that is not a TailLaunch switch is refused before any GPU work."""

import pytest

from benchmarks.bench_tails import main


@pytest.mark.parametrize("flag", ["nope", "block_e", "num_warps"])
def test_ab_names_a_tail_launch_switch(flag):
    with pytest.raises(SystemExit, match=f"--ab '{flag}': not a TailLaunch flag; one of "
                                         "unroll_k, packed_topk, prefetch_w"):
        main(["--ab", flag])
