"""benchmarks/exp_moe_timeline.py's reading of a trace, on synthetic stamps (the stamps themselves
need a GPU: tests/kernels/test_moe.py
test_moe_tp8_traced_down_gives_the_same_bits_and_ordered_stamps)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.exp_moe_timeline import launch_stats, main, milestones, summarize, table
from kernels.timeline import SLOTS, SM_SLOT


def synthetic(launches: int = 3, rows: int = 8, tiles: int = 4, live: int = 6) -> torch.Tensor:
    """Launch l starts at 10 ms + 1 ms·l (a timer never reads 0); live program (r, t) starts
    1 µs + 100 ns·(r·T + t) after it, passes its exit 200 ns later, then expert k takes (1 + k)
    µs (+ 1 µs more for expert 0), stores 300 ns after the last; programs on SM (r·T + t) mod
    5. Padding rows stamp their start only, at the launch's start."""
    tr = torch.zeros(launches, rows, tiles, SLOTS, dtype=torch.int64)
    for l in range(launches):
        for r in range(rows):
            for t in range(tiles):
                pid = r * tiles + t
                base = 10_000_000 + 1_000_000 * l
                s = base + 1_000 + 100 * pid
                tr[l, r, t, SM_SLOT] = pid % 5
                if r >= live:
                    tr[l, r, t, 0] = base
                    continue
                stamps = [s, s + 200]
                for k in range(8):
                    stamps.append(stamps[-1] + 1_000 * (1 + k) + (1_000 if k == 0 else 0))
                stamps.append(stamps[-1] + 300)
                tr[l, r, t, :11] = torch.tensor(stamps)
    return tr


def flat(tr: torch.Tensor) -> torch.Tensor:
    return tr.view(tr.shape[0], -1, SLOTS)


def test_launch_stats_read_the_milestones():
    tr = synthetic()
    st = launch_stats(flat(tr))
    last = 6 * 4 - 1  # the last live program
    assert torch.allclose(st["last start"], torch.full((3,), (1_000 + 100 * last) / 1e3,
                                                       dtype=torch.float64))
    assert torch.allclose(st["expert 0"], torch.full((3,), 2.0, dtype=torch.float64))
    for k in range(1, 8):
        assert torch.allclose(st[f"expert {k}"], torch.full((3,), 1.0 + k, dtype=torch.float64))
    end = 1_000 + 100 * last + 200 + 1_000 * 37 + 300
    assert torch.allclose(st["stored"], torch.full((3,), end / 1e3, dtype=torch.float64))
    assert st["programs / SM"].tolist() == [5.0] * 3  # 24 live programs over 5 SMs
    assert list(st) == list(milestones("down"))
    s = summarize(st)
    assert s["expert 3"] == [4.0, 4.0, 4.0]
    assert "| expert 7 | 8.00 [8.00, 8.00] |" in table(
        [{"rows": 6, "distinct": 44, "graph_us": 50.0, "down": s}], "down")
    head = table([{"rows": 6, "distinct": 44, "graph_us": 50.0, "down": s},
                  {"rows": 6, "distinct": 44, "graph_us": 40.0, "down": s,
                   "variant": "down_stages=3"}], "down").splitlines()[0]
    assert head == "| down | 6 rows (44 experts) | 6 rows (44 experts), down_stages=3 |"


def test_steps_a_loop_does_not_have_are_nan():
    """gate/up's split of 6 blocks stamps slots 2 … 7 only: blocks 6 and 7 read NaN."""
    tr = flat(synthetic())
    tr[:, :, 8:10] = 0
    st = launch_stats(tr, "gate_up")
    assert list(st)[2:10] == [f"block {k}" for k in range(8)]
    assert torch.allclose(st["block 5"], torch.full((3,), 6.0, dtype=torch.float64))
    assert st["block 6"].isnan().all() and st["block 7"].isnan().all()
    assert summarize(st)["block 7"][1] != summarize(st)["block 7"][1]  # NaN


def test_programs_past_no_exit_do_not_count_but_start_the_clock():
    tr = synthetic()
    six, four = launch_stats(flat(tr)), launch_stats(flat(synthetic(live=4)))
    assert (four["stored"] < six["stored"]).all()
    tr[:, 6:, :, 0] = 0  # no padding program stamped: the clock starts at the first live one
    assert torch.allclose(launch_stats(flat(tr))["exit"], six["exit"] - 1.0)


def test_refusals(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--rows", "3"])  # bench_moe defines no routing for 3 rows
    with pytest.raises(SystemExit):
        main(["--launches", "0"])
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit):
        main(["--raw", str(tmp_path / "f")])
    assert "exists and is not a folder" in capsys.readouterr().err

def test_variants_are_checked_before_any_gpu_work(capsys):
    for bad, says in (("down_rows=0", "row-major loop (down_rows on)"),
                      ("down_stage=3", "is not FIELD=VALUE"),
                      ("down_stages=x", "takes an integer")):
        with pytest.raises(SystemExit) as e:
            main(["--rows", "6", "--variant", bad])
        assert says in f"{e.value.code}{capsys.readouterr().err}", bad
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["--rows", "6"])
        # the hoisted loop is stamped too: its variant passes the checks and meets the GPU's
        with pytest.raises(SystemExit) as e:
            main(["--rows", "6", "--variant", "down_hoist=1,down_stages=3"])
        assert "needs a CUDA GPU" in f"{e.value.code}{capsys.readouterr().err}"
