"""Where a tail's time goes: per-program timestamps (kernels/timeline.py) of the attention tail
with its folded router, the attention tail alone and the MoE tail, at the real shape, inside a
CUDA graph of back-to-back launches as in a decode round.

    python -m benchmarks.exp_tail_timeline --rows 6 --npart 8 --json timeline.json
    python -m benchmarks.exp_tail_timeline --variant prefetch_w=1 --variant block_e=4

Every configuration is checked against its twin first (benchmarks/bench_tails.py
check_against_twin). Inputs as bench_tails: partials written (no producer to wait for), router
weights cycling through 40 copies so that they stream from HBM. Each launch's stamps are
measured from its first program's start (slot 0); the table gives, over all launches of all
replays, the median and the 10th / 90th percentile of each milestone:

  rows summed / stored / end  the last live row program's partial sum read, outputs and router
                              input stored, quantization done
  router start                the last router program to start
  input first / last          the first and the last router program whose wait for the rows'
                              router input is over (NaN readiness: its last chunk's wait)
  logits first / last         the first and the last router program with its logits computed
  softmax / top-k / published the routing program's finish (kernels/router.py _route_finish):
                              softmax done, top-k chosen, ids and weights stored
  routed                      the routing program's softmax → top-k → renormalize done
  end                         the last stamp of the launch

The stamps do not include the launch's own start-up before its first program, nor its drain
after the last stamp; `graph µs` (the untraced graph's time per launch in the same run) does.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.bench_tails import Spec, build, check_against_twin, kernel_call
from benchmarks.timing import capture_graph, time_graph
from kernels.timeline import SLOTS, SM_SLOT

MILESTONES = ("rows summed", "rows stored", "rows end", "router start", "input first",
              "input last", "logits first", "logits last", "softmax", "top-k", "published",
              "routed", "end")
INPUT_SLOT = 8  # a router program's "input seen" (kernels/router.py)
FINISH = {"softmax": 4, "top-k": 5, "published": 6}  # the routing program's slots


def milestones(trace: torch.Tensor, live: int, rows: int) -> dict[str, torch.Tensor]:
    """trace [L, P, SLOTS] int64 (L launches; programs 0..rows−1 are row programs, the rest router
    programs) → {milestone: [L] µs since each launch's first program start}; router
    milestones only when the launch had router programs."""
    t = trace.double()
    t0 = t[:, :, 0].min(dim=1).values[:, None]  # [L, 1]
    us = (t - t0[:, :, None]) / 1e3  # [L, P, SLOTS]
    stamped = trace[:, :, :SM_SLOT] > 0
    out = {"rows summed": us[:, :live, 1].max(dim=1).values,
           "rows stored": us[:, :live, 2].max(dim=1).values,
           "rows end": us[:, :live, 3].max(dim=1).values}
    if trace.shape[1] > rows:
        r = us[:, rows:]
        out["router start"] = r[:, :, 0].max(dim=1).values
        out["input first"] = r[:, :, INPUT_SLOT].min(dim=1).values
        out["input last"] = r[:, :, INPUT_SLOT].max(dim=1).values
        out["logits first"] = r[:, :, 1].min(dim=1).values
        out["logits last"] = r[:, :, 1].max(dim=1).values
        last = trace[:, rows:, 3] > 0  # [L, P − rows]: the routing program
        for name, slot in FINISH.items():
            out[name] = torch.where(last, r[:, :, slot], float("-inf")).max(dim=1).values
        out["routed"] = torch.where(last, r[:, :, 3], float("-inf")).max(dim=1).values
    out["end"] = torch.where(stamped, us[:, :, :SM_SLOT], float("-inf")).amax(dim=(1, 2))
    return out


def summarize(ms: dict[str, torch.Tensor]) -> dict[str, tuple[float, float, float]]:
    """{milestone: (median, p10, p90)} in µs."""
    q = torch.tensor([0.5, 0.1, 0.9], dtype=torch.float64)
    return {k: tuple(torch.quantile(v, q).tolist()) for k, v in ms.items()}


def run_one(spec: Spec, config, reps: int, trials: int, warmup: int) -> dict:
    from kernels.tails import tail_launch
    from kernels.tails_launch import chunk_grid
    from kernels.timeline import new_trace

    dev = torch.device("cuda")
    p = build(spec, dev)
    cfg = config or tail_launch(spec.hidden, spec.experts if spec.router else 0)
    check = check_against_twin(p, cfg)
    # row programs are K column chunks each (pid = row·K + chunk)
    groups = cfg.attn_chunk_groups if spec.router else cfg.moe_chunk_groups
    k = chunk_grid(groups, spec.hidden)[1]
    programs = spec.buffer_rows * k + (-(-spec.experts // cfg.block_e) if spec.router else 0)
    traces = new_trace(reps * programs, dev).view(reps, programs, SLOTS)
    copies = max(1, len(p.router_w))
    plain = [kernel_call(p, j, cfg) for j in range(copies)]
    graph_us = time_graph(plain, reps, trials, warmup)
    traced = [kernel_call(p, j % copies, cfg, trace=traces[j]) for j in range(reps)]
    graph = capture_graph(traced, reps)
    for _ in range(warmup):
        graph.replay()
    got = []
    for _ in range(trials):
        traces.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got.append(traces.cpu())
    if p.flag.item() != 0:
        raise AssertionError("failure flag set during the traced replays")
    ms = milestones(torch.cat(got), spec.rows * k, spec.buffer_rows * k)
    del graph, p
    torch.cuda.empty_cache()
    return {**asdict(spec), "launch": asdict(cfg), "check": check, "graph_us": graph_us,
            "launches": len(got) * reps, "milestones_us": summarize(ms)}


def table(results: list[dict]) -> str:
    head = "| tail | launch | graph µs | " + " | ".join(MILESTONES) + " |"
    lines = [head, "| --- | --- | --- | " + " | ".join("---" for _ in MILESTONES) + " |"]
    for r in results:
        cells = []
        for m in MILESTONES:
            v = r["milestones_us"].get(m)
            cells.append("" if v is None else f"{v[0]:.2f} ({v[1]:.2f}–{v[2]:.2f})")
        lines.append(f"| {r['tail']} | {r['label']} | {r['graph_us']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tails", nargs="+", default=["attn+router", "attn", "moe"],
                    choices=["attn+router", "attn", "moe"])
    ap.add_argument("--rows", type=int, default=6, help="live rows of the 8-row buffer")
    ap.add_argument("--npart", type=int, default=8, help="rank partials N")
    ap.add_argument("--variant", action="append", default=[], metavar="FIELDS",
                    help="TailLaunch fields over the pinned launch, e.g. prefetch_w=1,block_e=4 "
                         "(attn+router only; repeatable)")
    ap.add_argument("--reps", type=int, default=40, help="launches per CUDA graph")
    ap.add_argument("--trials", type=int, default=10, help="traced replays")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("tail_timeline.json"))
    args = ap.parse_args(argv)
    from iquestrt.launch_overrides import LaunchOverrides
    from kernels.tails import tail_launch

    # parsed (and rejected) before any GPU work
    variants = [LaunchOverrides.parse(",".join(f"tails.{f}" for f in v.split(",")))
                for v in args.variant]
    if not torch.cuda.is_available():
        raise SystemExit("exp_tail_timeline: needs a CUDA GPU (kernel timestamps are PTX)")
    results = []
    for tail in args.tails:
        spec = Spec(tail, args.rows, args.npart)
        configs = [("pinned", None)]
        if tail == "attn+router":
            configs += [(v.label(), v.tail_config(spec.hidden, spec.experts)) for v in variants]
        for label, cfg in configs:
            res = run_one(spec, cfg, args.reps, args.trials, args.warmup)
            res["label"] = label
            results.append(res)
            ms = res["milestones_us"]
            print(f"{tail} {label}: graph {res['graph_us']:.2f} µs/launch; "
                  + ", ".join(f"{k} {v[0]:.2f}" for k, v in ms.items()), flush=True)
    md = table(results)
    print(md)
    from iquestrt.report.provenance import code_identity

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "code": code_identity(),
            "pinned": {t: asdict(tail_launch(3072, 256 if t == "attn+router" else 0))
                       for t in args.tails}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": results, "table": md}, indent=2,
                                    default=str))
    print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
