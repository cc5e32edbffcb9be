"""The fused all-reduce over peer memory against NCCL's all-reduce, in one run on N GPUs
(target: one reduction at 4–8 rows in ≤ 10 µs at TP8):

    torchrun --nproc-per-node N -m benchmarks.bench_peer_reduce --out DIR [--rows 4 6 8]

Per reduction step, on every rank, with H = 3072 FP32 partials and the MoE tail as consumer:
  peer   the producer stores its partial into its ring slot (iquestrt/tp/peer_ring.py, torch
         symmetric memory); the MoE tail sums all ranks' slots through their address table,
         polling until NaN-free, and re-arms its own slot of the previous step.
  nccl   the producer stores its partial into a buffer; dist.all_reduce sums it over the
         ranks; the MoE tail reads the sum (one partial, no waiting).
  local  the producer store and the MoE tail on this rank's partial alone: no communication.
The reduction's cost is the variant minus `local`. Each variant is a CUDA graph of `steps`
reduction steps (a multiple of the ring's 3 slots, so replays continue the ring), replayed after
a barrier; the variants alternate within every trial (ratios from one run); medians per step.
Before timing, the peer variant's output is checked bit for bit against the tail over the
all-gathered partials in rank order (the same sum), and every readiness flag must stay 0.

Rank 0 writes DIR/bench_peer_reduce.json (raw per-trial times, environment, command) and
DIR/bench_peer_reduce.md (the table). Needs N CUDA GPUs, one per process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

VARIANTS = ("peer", "nccl", "local")
TARGET_US = 10.0
EPS, FFN_SCALE = 1e-6, 0.53881590608


@dataclass(frozen=True)
class BenchConfig:
    rows: tuple[int, ...] = (4, 6, 8)  # live rows of an 8-row buffer
    hidden: int = 3072
    buffer_rows: int = 8
    steps: int = 63  # reduction steps per graph (a multiple of the ring's 3 slots)
    trials: int = 30
    warmup: int = 3
    max_polls: int = 1 << 22  # bounded wait of a consumer (µs-scale polls: seconds)
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.steps < 3 or self.steps % 3:
            raise ValueError(f"--steps: must be a positive multiple of 3, got {self.steps}")
        if not self.rows or any(not 1 <= r <= self.buffer_rows for r in self.rows):
            raise ValueError(f"--rows: each must be in [1, {self.buffer_rows}], got {self.rows}")
        for name in ("trials", "warmup"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}: must be >= 1, got {getattr(self, name)}")


def summarize(raw: dict[str, dict[str, list[float]]]) -> list[dict]:
    """raw[rows][variant] = µs per step per trial → one row per rows value: medians, and the
    reductions' cost as the per-trial difference to `local` (median of the differences)."""
    out = []
    for rows, per in raw.items():
        med = {v: statistics.median(per[v]) for v in VARIANTS}
        cost = {v: statistics.median(a - b for a, b in zip(per[v], per["local"], strict=True))
                for v in ("peer", "nccl")}
        out.append({"rows": int(rows), **{f"{v}_us": med[v] for v in VARIANTS},
                    "peer_reduce_us": cost["peer"], "nccl_reduce_us": cost["nccl"],
                    "peer_vs_nccl": med["peer"] / med["nccl"]})
    return out


def render(table: list[dict], world: int) -> str:
    lines = [f"| rows | peer µs/step | nccl µs/step | local µs/step | peer reduction µs "
             f"(target ≤ {TARGET_US:g} at TP8) | nccl reduction µs | peer ÷ nccl |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in table:
        lines.append(f"| {r['rows']} | {r['peer_us']:.2f} | {r['nccl_us']:.2f} | "
                     f"{r['local_us']:.2f} | {r['peer_reduce_us']:.2f} | "
                     f"{r['nccl_reduce_us']:.2f} | {r['peer_vs_nccl']:.3f} |")
    return f"TP{world}, H 3072 FP32 partials, MoE tail as consumer\n\n" + "\n".join(lines)


def _run(cfg: BenchConfig, out: Path) -> None:
    import torch.distributed as dist

    from benchmarks.timing import capture_graph
    from iquestrt.tp import group as tp_group
    from iquestrt.tp.peer_ring import symmetric_ring
    from kernels.row_chunks import RowChunkScratch
    from kernels.tails import moe_tail

    g = tp_group.init_group(timeout_s=cfg.timeout_s)
    if g.backend != "nccl":
        raise SystemExit("bench_peer_reduce: needs one CUDA GPU per rank (nccl)")
    dev, r_buf, h_dim = g.device, cfg.buffer_rows, cfg.hidden
    ring = symmetric_ring(g, r_buf, h_dim)
    gen = torch.Generator().manual_seed(100 + g.rank)
    src = [torch.randn(r_buf, h_dim, generator=gen).to(dev) for _ in range(2)]  # producer data
    h = torch.randn(r_buf, h_dim, generator=gen).bfloat16().to(dev)
    w = torch.ones(h_dim, dtype=torch.bfloat16, device=dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    buf = torch.empty(r_buf, h_dim, device=dev)
    step = {"t": 0}

    chunks = RowChunkScratch.create(dev)  # one for every call: a fresh one is a fill launch

    def tail(parts, n_live, rearm=None, polls=cfg.max_polls):
        return moe_tail(parts, h, w, n_live, flag, eps=EPS, ffn_out_scale=FFN_SCALE,
                        max_polls=polls, rearm=rearm, chunk_scratch=chunks)

    def check(n: int, n_live) -> None:
        t = step["t"]
        ring.produce(t)[0, :n] = src[0][:n]
        got = tail(ring.consume(t), n_live, ring.rearm(t)).xn[:n].clone()
        step["t"] += 1
        gathered = torch.empty(g.world, r_buf, h_dim, device=dev)
        dist.all_gather_into_tensor(gathered, src[0].contiguous())
        want = tail(gathered, n_live, polls=1).xn[:n]
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            raise SystemExit(f"rank {g.rank}: the peer reduction differs from the all-gathered "
                             f"sum at {n} rows")

    raw: dict[str, dict[str, list[float]]] = {}
    for n in cfg.rows:
        n_live = torch.tensor([n], dtype=torch.int32, device=dev)
        check(n, n_live)
        while step["t"] % 3:  # every graph starts at slot 0: complete the ring's cycle first
            check(n, n_live)

        def peer_call(j, n=n, n_live=n_live):
            def call():  # step j of a graph: slot j mod 3, as the steps before it left the ring
                ring.produce(j)[0, :n] = src[j % 2][:n]
                tail(ring.consume(j), n_live, ring.rearm(j))
            return call

        def nccl_call(j, n=n, n_live=n_live):
            def call():
                buf[:n] = src[j % 2][:n]
                dist.all_reduce(buf)
                tail(buf[None], n_live, polls=1)
            return call

        def local_call(j, n=n, n_live=n_live):
            def call():
                buf[:n] = src[j % 2][:n]
                tail(buf[None], n_live, polls=1)
            return call

        makers = {"peer": peer_call, "nccl": nccl_call, "local": local_call}
        graphs = {}
        for v in VARIANTS:
            dist.barrier()
            graphs[v] = capture_graph([makers[v](j) for j in range(cfg.steps)], cfg.steps)
        per = {v: [] for v in VARIANTS}
        for trial in range(cfg.warmup + cfg.trials):
            for v in VARIANTS:
                dist.barrier()
                torch.cuda.synchronize(dev)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                graphs[v].replay()
                end.record()
                end.synchronize()
                if trial >= cfg.warmup:
                    per[v].append(start.elapsed_time(end) * 1e3 / cfg.steps)
        if int(flag.item()):
            raise SystemExit(f"rank {g.rank}: a readiness wait timed out at {n} rows")
        raw[str(n)] = per
        if g.rank == 0:
            s = summarize({str(n): per})[0]
            print(f"[rows {n}] peer {s['peer_us']:.2f} µs/step, nccl {s['nccl_us']:.2f}, local "
                  f"{s['local_us']:.2f}", flush=True)
        del graphs
    if g.rank == 0:
        _write(out, cfg, raw, g.world)
    tp_group.close_group()


def _write(out: Path, cfg: BenchConfig, raw: dict, world: int) -> None:
    from benchmarks.rank.record import environment

    table = summarize(raw)
    out.mkdir(parents=True, exist_ok=True)
    record = {"config": asdict(cfg), "world": world, "command": " ".join(sys.argv),
              "env": environment(), "raw_us_per_step": raw, "table": table}
    tmp = out / "bench_peer_reduce.json.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    (out / "bench_peer_reduce.md").write_text(render(table, world) + "\n")
    tmp.replace(out / "bench_peer_reduce.json")
    print(render(table, world))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = BenchConfig()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int, nargs="+", default=list(d.rows))
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--trials", type=int, default=d.trials)
    p.add_argument("--warmup", type=int, default=d.warmup)
    a = p.parse_args(argv)
    try:
        cfg = BenchConfig(rows=tuple(a.rows), steps=a.steps, trials=a.trials, warmup=a.warmup)
    except ValueError as e:
        p.error(str(e))
    _run(cfg, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
