"""Where the row-major MoE down's time goes: per-program timestamps (kernels/timeline.py) of the
pinned `_moe_down_rows_kernel` inside a CUDA graph of back-to-back moe_fp8 calls, each on the
next of bench_moe's disjoint expert sets (so the weights stream from HBM as in a decode round).

    python -m benchmarks.exp_moe_timeline --rows 1 6 8 --json moe_timeline.json

Every row count is checked against the twin first (benchmarks/bench_moe.py check_against_twin).
Each call's down launch is stamped into its own trace; a launch's stamps are measured from its
first program's start. Per row count, over all launches of all replays, the median and the
10th / 90th percentile of:

  last start       the last live program's start: how long the grid takes to become resident
  exit             the median live program past its live-row check
  expert k         the median live program's time from its previous stamp to expert k's term
                   summed (expert 0: from the exit, so the pipeline's first tiles included)
  stored           the last live program's store
  programs / SM    the most live programs of one launch that ran on one SM

`graph µs` is the untraced call's time (gate/up, SiLU and down) in the same run, for scale.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.bench_moe import DEFAULT_DISTINCT, BenchSpec, build_problem, check_against_twin
from benchmarks.timing import capture_graph, time_graph
from kernels.timeline import SLOTS, SM_SLOT

EXPERT_SLOTS = 8  # slots 2 … 9: one per expert of the top-8 (kernels/moe.py)
MILESTONES = ("last start", "exit", *(f"expert {k}" for k in range(EXPERT_SLOTS)), "stored",
              "programs / SM")


def launch_stats(trace: torch.Tensor, live: int) -> dict[str, torch.Tensor]:
    """trace [L, R, T, SLOTS] int64 (L launches of R rows × T hidden tiles) → {milestone: [L]}
    (µs; programs / SM a count) over the live rows' programs."""
    n = trace.shape[0]
    starts = trace[..., 0].reshape(n, -1).double()
    t0 = starts.where(starts > 0, torch.inf).min(dim=1).values  # [L] first stamped start
    t = trace[:, :live].reshape(n, -1, SLOTS).double()  # [L, P, SLOTS]
    us = (t - t0[:, None, None]) / 1e3
    out = {"last start": us[:, :, 0].max(dim=1).values,
           "exit": us[:, :, 1].median(dim=1).values}
    steps = (t[:, :, 2:2 + EXPERT_SLOTS] - t[:, :, 1:1 + EXPERT_SLOTS]) / 1e3  # [L, P, 8]
    for k in range(EXPERT_SLOTS):
        out[f"expert {k}"] = steps[:, :, k].median(dim=1).values
    out["stored"] = us[:, :, 10].max(dim=1).values
    sm = trace[:, :live, :, SM_SLOT].reshape(n, -1)
    out["programs / SM"] = torch.stack([torch.bincount(s).max() for s in sm]).double()
    return out


def summarize(stats: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """{milestone: [L]} → {milestone: [p10, median, p90]}."""
    q = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    return {k: [round(float(x), 3) for x in torch.quantile(v, q)] for k, v in stats.items()}


def run_rows(rows: int, distinct: int, launches: int, replays: int, trials: int) -> dict:
    from kernels.moe import moe_fp8, moe_launch
    from kernels.timeline import new_trace

    dev = torch.device("cuda")
    spec = BenchSpec(rows, distinct)
    p = build_problem(spec, dev)
    check = check_against_twin(p)
    cfg = moe_launch(spec.hidden, spec.inter)
    tiles = -(-spec.hidden // cfg.down_block_n)
    out = torch.empty(spec.buffer_rows, spec.hidden, dtype=torch.bfloat16, device=dev)
    traces = [new_trace(spec.buffer_rows * tiles, dev) for _ in range(launches)]

    def call(j: int, trace=None):
        s = j % p.sets
        return lambda: moe_fp8(p.x, p.weights[s], p.ids[s], p.fc[0], p.fc_s[0], p.proj[0],
                               p.proj_s[0], p.n_live, out=out, config=cfg, trace=trace)

    graph_us = time_graph([call(j) for j in range(launches)], launches, trials, 3)
    graph = capture_graph([call(j, traces[j]) for j in range(launches)], launches)
    got = []
    for _ in range(replays):
        for t in traces:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got.append(torch.stack(traces).cpu().view(launches, spec.buffer_rows, tiles, SLOTS))
    stats = launch_stats(torch.cat(got), rows)
    return {"rows": rows, "distinct": distinct, "launches": launches * replays,
            "graph_us": graph_us, "check": check, "milestones": summarize(stats)}


def table(results: list[dict]) -> str:
    head = "| milestone | " + " | ".join(f"{r['rows']} rows ({r['distinct']} experts)"
                                         for r in results) + " |"
    lines = [head, "|" + " --- |" * (len(results) + 1)]
    for m in MILESTONES:
        cells = [f"{v[1]:.2f} [{v[0]:.2f}, {v[2]:.2f}]" for v in
                 (r["milestones"][m] for r in results)]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("| graph µs (untraced call) | " + " | ".join(f"{r['graph_us']:.1f}"
                                                          for r in results) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6, 8])
    ap.add_argument("--launches", type=int, default=24, help="calls per graph (≥ 1)")
    ap.add_argument("--replays", type=int, default=4, help="traced graph replays (≥ 1)")
    ap.add_argument("--trials", type=int, default=20, help="untraced graph replays timed")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    distinct = dict(DEFAULT_DISTINCT)
    bad = [r for r in a.rows if r not in distinct]
    if bad:
        ap.error(f"--rows: {bad} not in {sorted(distinct)} (the routings bench_moe defines)")
    if a.launches < 1 or a.replays < 1 or a.trials < 1:
        ap.error("--launches, --replays and --trials: expected >= 1")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the stamps read the GPU's %globaltimer)")
    results = []
    for r in a.rows:
        results.append(run_rows(r, distinct[r], a.launches, a.replays, a.trials))
        print(f"[{r} rows] checked: {results[-1]['check']['kernel_vs_twin']}", flush=True)
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
        print(f"wrote {a.json}")
    return results


if __name__ == "__main__":
    main()
