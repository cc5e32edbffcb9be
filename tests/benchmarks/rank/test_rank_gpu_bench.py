"""pytest-benchmark wrapper of the per-rank round benchmark (GPU only): the --quick sweep (1K,
width 6) at real per-rank shapes, its numbers in the benchmark's extra_info. The full sweep is
`python -m benchmarks.rank --out DIR` (benchmarks/rank/main.py)."""

import pytest

from benchmarks.rank.spec import SweepSpec
from benchmarks.rank.sweep import run_sweep


@pytest.mark.gpu
def test_round_benchmark_quick(benchmark, tmp_path):
    spec = SweepSpec(widths=(6,), adaptive=False, contexts=("1K",), rounds=16, reps=1,
                     baseline="none", profile="key", eager=False)
    rec = benchmark.pedantic(run_sweep, args=(spec, tmp_path / "rank", "pytest-benchmark"),
                             rounds=1, iterations=1)
    row = rec["configs"][0]
    assert "error" not in row, row.get("error")
    benchmark.extra_info.update(round_ms=row["round_s"] * 1e3, floor_ms=row["floor_s"] * 1e3,
                                ratio=row["ratio"], launches=row["breakdown"]["launches"],
                                distinct=row["shape"]["distinct"])
    # a round can't beat the bytes it must read: below 0.9 × floor the clock or floor is wrong
    assert row["ratio"] > 0.9
