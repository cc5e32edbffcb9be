"""Where the MoE's two GEMM launches spend their time: per-program timestamps
(kernels/timeline.py) of the pinned gate/up (`_moe_gate_up_kernel`) and row-major down
(`_moe_down_rows_kernel`) inside a CUDA graph of back-to-back moe_fp8 calls, each on the next of
bench_moe's disjoint expert sets (so the weights stream from HBM as in a decode round).

    python -m benchmarks.exp_moe_timeline --rows 1 6 8 --json moe_timeline.json
    python -m benchmarks.exp_moe_timeline --rows 6 --variant down_ids_ahead=1,down_stages=3

--variant FIELD=V,… (MoeLaunch fields, as bench_moe's) stamps that launch configuration too,
after the pinned one at each row count; the down's stamps need its row-major loop (down_rows),
hoisted or not (`--variant down_hoist=1,down_stages=3`: the loop with no synchronous load).
--raw DIR saves every stamped launch as well: DIR/{rows}rows_{variant}.pt, {"gate_up", "down":
int64 [replays·launches, programs, slots]} (slot 0 start ns, slot SM_SLOT the SM; which SM ran
which program, for placement studies).

Every row count is checked against the twin first (benchmarks/bench_moe.py check_against_twin).
Each call's two launches are stamped into their own traces; a launch's stamps are measured from
its first program's start, over the programs that pass their exit (the down: live rows; gate/up:
each routed expert's lead slot). Per row count, over all launches of all replays, the median and
the 10th / 90th percentile of:

  last start         the last such program's start: how long the grid takes to become resident
  exit               the median program past its exit
  expert k / block k the median program's time from its previous stamp to step k done (the
                     down: expert k's term summed; gate/up: hidden block k of its K split; step
                     0 from the exit, so the pipeline's first tiles included; NaN: no such step)
  stored             the last such program's store
  programs / SM      the most such programs of one launch that ran on one SM

`graph µs` is the untraced call's time (gate/up, SiLU and down) in the same run, for scale.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.bench_moe import DEFAULT_DISTINCT, BenchSpec, build_problem, check_against_twin
from benchmarks.launch_variant import parse_variant
from benchmarks.timing import capture_graph, time_graph
from kernels.moe_launch import moe_launch
from kernels.timeline import SM_SLOT

STEP_SLOTS = 8  # slots 2 … 9: the down's experts, gate/up's hidden blocks (kernels/moe.py)


def milestones(kind: str) -> tuple[str, ...]:
    step = {"down": "expert", "gate_up": "block"}[kind]
    return ("last start", "exit", *(f"{step} {k}" for k in range(STEP_SLOTS)), "stored",
            "programs / SM")


def launch_stats(trace: torch.Tensor, kind: str = "down") -> dict[str, torch.Tensor]:
    """trace [L, P, SLOTS] int64 (L launches of P programs; kind "down" or "gate_up") → {milestone:
    [L]} (µs from each launch's first stamped start; programs / SM a count) over the programs
    that passed their exit (slot 1 stamped: live rows of the down, lead slots of gate/up)."""
    names = milestones(kind)
    out = {m: torch.empty(trace.shape[0], dtype=torch.float64) for m in names}
    for i, tr in enumerate(trace):
        starts = tr[:, 0].double()
        t0 = starts[starts > 0].min()
        went = tr[tr[:, 1] > 0]  # [P', SLOTS]
        us = (went.double() - t0) / 1e3
        out["last start"][i] = us[:, 0].max()
        out["exit"][i] = us[:, 1].median()
        steps = (went[:, 2:2 + STEP_SLOTS] - went[:, 1:1 + STEP_SLOTS]).double() / 1e3
        steps[went[:, 2:2 + STEP_SLOTS] == 0] = torch.nan  # a step the loop does not have
        for k in range(STEP_SLOTS):
            out[names[2 + k]][i] = steps[:, k].nanmedian()
        out["stored"][i] = us[:, 10].max()
        out["programs / SM"][i] = float(torch.bincount(went[:, SM_SLOT]).max())
    return out


def summarize(stats: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """{milestone: [L]} → {milestone: [p10, median, p90]} (NaN: a step no launch has)."""
    q = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    return {k: [round(float(x), 3) for x in torch.nanquantile(v, q)] for k, v in stats.items()}


def run_rows(rows: int, distinct: int, launches: int, replays: int, trials: int,
             cfg=None, label: str = "pinned", raw: Path | None = None) -> dict:
    """cfg: a MoeLaunch (None: the pinned one), named label in the tables; raw: a folder for
    the stamps themselves."""
    from kernels.moe import moe_fp8
    from kernels.timeline import new_trace

    dev = torch.device("cuda")
    spec = BenchSpec(rows, distinct)
    p = build_problem(spec, dev)
    cfg = cfg or moe_launch(spec.hidden, spec.inter)
    check = check_against_twin(p, cfg)
    programs = {"down": spec.buffer_rows * -(-spec.hidden // cfg.down_block_n),
                "gate_up": spec.buffer_rows * spec.top_k * -(-spec.inter // cfg.gate_up_block_n)
                * cfg.k_splits(spec.hidden)}
    out = torch.empty(spec.buffer_rows, spec.hidden, dtype=torch.bfloat16, device=dev)
    traces = {k: [new_trace(n, dev) for _ in range(launches)] for k, n in programs.items()}

    def call(j: int, traced: bool):
        s = j % p.sets
        tr = dict(trace=traces["down"][j], gate_up_trace=traces["gate_up"][j]) if traced else {}
        return lambda: moe_fp8(p.x, p.weights[s], p.ids[s], p.fc[0], p.fc_s[0], p.proj[0],
                               p.proj_s[0], p.n_live, out=out, config=cfg, **tr)

    graph_us = time_graph([call(j, False) for j in range(launches)], launches, trials, 3)
    graph = capture_graph([call(j, True) for j in range(launches)], launches)
    got = {k: [] for k in traces}
    for _ in range(replays):
        for t in (*traces["down"], *traces["gate_up"]):
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for k, ts in traces.items():
            got[k].append(torch.stack(ts).cpu())
    if raw is not None:
        torch.save({k: torch.cat(v) for k, v in got.items()}, raw / f"{rows}rows_{label}.pt")
    return {"rows": rows, "distinct": distinct, "variant": label, "launches": launches * replays,
            "graph_us": graph_us, "check": check,
            **{k: summarize(launch_stats(torch.cat(v), k)) for k, v in got.items()}}


def table(results: list[dict], kind: str) -> str:
    head = f"| {kind} | " + " | ".join(
        f"{r['rows']} rows ({r['distinct']} experts)"
        + ("" if r.get("variant", "pinned") == "pinned" else f", {r['variant']}")
        for r in results) + " |"
    lines = [head, "|" + " --- |" * (len(results) + 1)]
    for m in milestones(kind):
        cells = [f"{v[1]:.2f} [{v[0]:.2f}, {v[2]:.2f}]" for v in (r[kind][m] for r in results)]
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
    ap.add_argument("--variant", action="append", default=[], metavar="FIELD=V,…",
                    help="MoeLaunch fields changed from the pinned launch (repeatable)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--raw", type=Path, metavar="DIR", help="save the stamps too (a folder)")
    a = ap.parse_args(argv)
    if a.raw is not None and a.raw.exists() and not a.raw.is_dir():
        ap.error(f"--raw {a.raw}: exists and is not a folder")
    distinct = dict(DEFAULT_DISTINCT)
    bad = [r for r in a.rows if r not in distinct]
    if bad:
        ap.error(f"--rows: {bad} not in {sorted(distinct)} (the routings bench_moe defines)")
    if a.launches < 1 or a.replays < 1 or a.trials < 1:
        ap.error("--launches, --replays and --trials: expected >= 1")
    shape = BenchSpec(a.rows[0], distinct[a.rows[0]])  # every row count: the same H, I
    pinned = moe_launch(shape.hidden, shape.inter)
    configs = [("pinned", None)] + [parse_variant(v, pinned) for v in a.variant]
    bad = [name for name, c in configs[1:] if not c.down_rows]
    if bad:
        ap.error(f"--variant {bad[0]}: the down's stamps are in the row-major loop "
                 f"(down_rows on)")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the stamps read the GPU's %globaltimer)")
    if a.raw is not None:
        a.raw.mkdir(parents=True, exist_ok=True)
    results = []
    for r in a.rows:
        for name, cfg in configs:
            results.append(run_rows(r, distinct[r], a.launches, a.replays, a.trials, cfg, name,
                                    a.raw))
            print(f"[{r} rows, {name}] checked: {results[-1]['check']['kernel_vs_twin']}",
                  flush=True)
    for kind in ("gate_up", "down"):
        print(table(results, kind))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
        print(f"wrote {a.json}")
    return results


if __name__ == "__main__":
    main()
