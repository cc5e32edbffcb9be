"""benchmarks/bench_qkv_rope.py on the CPU: its argument checks and its table (the timing and
the bit check need a GPU: the device runs them)."""

from __future__ import annotations

import pytest

from benchmarks.bench_qkv_rope import BenchConfig, main, table_md


@pytest.mark.parametrize("kw", [dict(rows=(0,)), dict(rows=(9,)), dict(rows=()),
                                dict(layers=0), dict(sets=0), dict(warmup=-1)])
def test_bad_config_is_refused(kw):
    with pytest.raises(ValueError):
        BenchConfig(**kw)


def test_bad_rows_exit_through_argparse(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path), "--rows", "12"])
    assert e.value.code == 2 and "--rows" in capsys.readouterr().err


def test_table_gives_median_ratio_and_spread():
    sets = [{"two launches": 10.0, "folded": 9.0}, {"two launches": 10.0, "folded": 8.0},
            {"two launches": 12.0, "folded": 12.0}]
    md = table_md([dict(rows=6, sets=sets)])
    assert "| 6 | 10.00 | 9.00 | 0.900 (0.800–1.000) |" in md
