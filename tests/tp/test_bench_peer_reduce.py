"""benchmarks/bench_peer_reduce.py: its settings are checked before any process group exists,
its table comes from the raw per-trial times (costs as differences to the local variant), and on
two GPUs the whole benchmark runs under torchrun and writes its record."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tp_harness import free_port

from benchmarks.bench_peer_reduce import BenchConfig, main, render, summarize


def test_settings_are_refused_before_any_work(capsys):
    for argv, msg in ((["--steps", "64"], "multiple of 3"), (["--rows", "9"], "in [1, 8]"),
                      (["--trials", "0"], "--trials: must be >= 1")):
        with pytest.raises(SystemExit):
            main(["--out", "unused", *argv])
        assert msg in capsys.readouterr().err
    with pytest.raises(ValueError, match="multiple of 3"):
        BenchConfig(steps=0)


def test_summary_medians_and_costs():
    raw = {"6": {"peer": [9.0, 10.0, 30.0], "nccl": [20.0, 21.0, 22.0], "local": [4.0, 5.0, 4.0]}}
    (row,) = summarize(raw)
    assert row["rows"] == 6 and row["peer_us"] == 10.0 and row["local_us"] == 4.0
    assert row["peer_reduce_us"] == 5.0  # median of 5, 5, 26: per-trial differences
    assert row["nccl_reduce_us"] == 16.0  # median of 16, 16, 18
    assert row["peer_vs_nccl"] == pytest.approx(10.0 / 21.0)
    text = render([row], 2)
    assert "TP2" in text and "| 6 | 10.00 | 21.00 | 4.00 | 5.00 | 16.00 | 0.476 |" in text


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one per NCCL rank)")
def test_runs_under_torchrun_on_two_gpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m",
           "benchmarks.bench_peer_reduce", "--out", str(tmp_path), "--rows", "4", "8",
           "--trials", "5", "--warmup", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads((tmp_path / "bench_peer_reduce.json").read_text())
    assert [r["rows"] for r in rec["table"]] == [4, 8] and rec["world"] == 2
    assert all(len(rec["raw_us_per_step"]["4"][v]) == 5 for v in ("peer", "nccl", "local"))
    print("\n" + (tmp_path / "bench_peer_reduce.md").read_text())
