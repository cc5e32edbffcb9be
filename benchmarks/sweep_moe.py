"""Launch-config sweep and stage breakdown for kernels.moe at per-rank TP8 shapes (H200).

    python -m benchmarks.sweep_moe --json sweep_moe.json

For each candidate MoeLaunch and row count: the whole op (act-quant, gate/up, act-quant, down,
combine) and gate/up alone (act-quant + gate/up) as CUDA-graph replays cycling disjoint expert
sets (weights streamed from HBM, as in benchmarks/bench_moe.py); the down share is the
difference. Each candidate's output is checked against the pinned config's bits first: launch
configs may change accumulation order only inside the tolerance row, so any difference is
reported with its margin. Used to choose kernels/moe.py::moe_launch.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.bench_moe import BenchSpec, build_problem, must_move_bytes, time_graph
from kernels.moe import MoeLaunch, moe_fp8, moe_gate_up_fp8
from qualification.tolerances import measure, tolerance

DISTINCT = {1: 8, 4: 30, 6: 44, 8: 57}


def candidates() -> list[MoeLaunch]:
    """The neighbourhood of the pinned config: gate/up tile × K-split length × warps, down tile ×
    warps (stages as pinned; deeper pipelines measured slower on the H200:
    reports/benchmarks/h200-2026-11-29/sweep_moe.log,
    reports/benchmarks/h200-2026-12-01/session9/exp_moe_call1.log, exp_router_moe_call2.log)."""
    return [
        MoeLaunch(gate_up_block_n=gu, down_block_n=dn, combine_block_h=512, num_warps=4,
                  gate_up_stages=3, down_stages=2, gate_up_k_blocks=kb, gate_up_warps=gw,
                  down_warps=dw)
        for gu, kb, gw, dn, dw in itertools.product((16, 32, 64), (24, 8, 6, 4), (2, 4),
                                                    (64, 128), (2, 4))
    ]


def run(rows: int, reps: int, trials: int) -> list[dict]:
    spec = BenchSpec(rows=rows, distinct=DISTINCT[rows])
    p = build_problem(spec, torch.device("cuda"))
    out = torch.empty(spec.buffer_rows, spec.hidden, dtype=torch.bfloat16, device="cuda")
    sets = range(p.sets)

    def whole(cfg, j):
        a = (p.x, p.weights[j], p.ids[j], p.fc[0], p.fc_s[0], p.proj[0], p.proj_s[0], p.n_live)
        return lambda: moe_fp8(*a, out=out, config=cfg)

    def gate_up(cfg, j):
        return lambda: moe_gate_up_fp8(p.x, p.ids[j], p.fc[0], p.fc_s[0], p.n_live, config=cfg)

    whole(None, 0)()
    pinned = out[:rows].float().clone()
    rows_out = []
    for cfg in candidates():
        whole(cfg, 0)()
        m = measure(out[:rows].float(), pinned, tolerance("kernels.moe.e2e", "bf16"))
        us = time_graph([whole(cfg, j) for j in sets], reps, trials, 3)
        gu = time_graph([gate_up(cfg, j) for j in sets], reps, trials, 3)
        moved = must_move_bytes(spec)
        r = {"rows": rows, "distinct": spec.distinct, "config": asdict(cfg), "us": us,
             "gate_up_us": gu, "down_combine_us": us - gu, "tbps": moved / us / 1e6,
             "vs_pinned": str(m)}
        rows_out.append(r)
        print(f"R={rows} gu{cfg.gate_up_block_n:<3} kb{cfg.gate_up_k_blocks:<3} "
              f"w{cfg.gate_up_warps} dn{cfg.down_block_n:<4} w{cfg.down_warps}"
              f" {us:7.2f} µs (gate/up {gu:6.2f}) {r['tbps']:5.2f} TB/s "
              f"{100 * r['tbps'] / 4.24:4.0f}%", flush=True)
    return rows_out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6])
    ap.add_argument("--reps", type=int, default=32)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--json", type=Path, default=Path("sweep_moe.json"))
    a = ap.parse_args(argv)
    res = [r for rows in a.rows for r in run(rows, a.reps, a.trials)]
    a.json.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
