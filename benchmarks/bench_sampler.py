"""Benchmark of kernels/sampler/ (GPU only): the fused top-k/top-p sampler against the
simplest torch formulation (topk + softmax + cumsum + searchsorted), in the same process.

Shapes: 8 × 160000 fp32 logits (target ≤ 20 µs), 1 × 160000, the 8-way sharded mode on one GPU
(8 × 20000 per virtual rank, three launches), and one TP8 rank's share: its local top-K on
[8, 20000] plus the final merge on the gathered [8, 8, KP] keys (all-gather not included).

Before timing, every kernel output is checked against the twin (reference.twins.sampler,
CPU): ids and tokens equal, probabilities within kernels.sampler.probs. Timing: CUDA events
around each call, median over --reps after --warmup calls; "eager" rotates through enough
logits copies (≥ 200 MB) that every call reads HBM, "graph" replays one captured CUDA graph
on one (L2-resident) buffer, as the engine does right after the lm_head. The torch baseline
gets the same uniforms as the kernel (precomputed; the kernel derives its own in-kernel).

    python benchmarks/bench_sampler.py [--reps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from iquestrt.capture import graph_capture
from kernels.sampler import (  # noqa: E402
    MAX_GROUPS,
    SampleOut,
    SamplerLaunch,
    sample,
    sample_from_candidates,
    topk_candidates,
)
from qualification.tolerances import check  # noqa: E402
from reference.config import SamplingDefaults  # noqa: E402
from reference.rng import Purpose, uniforms  # noqa: E402
from reference.twins.sampler import sample_ref  # noqa: E402

HBM_BYTES_PER_S = 4.24e12  # measured copy bandwidth of the H200 (read + write)
SEED = 20250611


@dataclass(frozen=True)
class BenchSpec:
    name: str
    rows: int
    vocab: int
    shards: int = 1  # virtual shards of `sample`
    tp_rank: bool = False  # time one rank's topk_candidates + the final merge instead


SPECS = (
    BenchSpec("8x160000", 8, 160000),
    BenchSpec("1x160000", 1, 160000),
    BenchSpec("8x160000 sharded 8x20000", 8, 160000, shards=8),
    BenchSpec("tp8 rank: 8x20000 local + merge", 8, 160000, shards=8, tp_rank=True),
)


@dataclass
class Problem:
    spec: BenchSpec
    params: SamplingDefaults
    copies: list[torch.Tensor]  # each [R, V] fp32 on the GPU
    positions: torch.Tensor  # [R] int64
    u: torch.Tensor  # [R] fp32, the TARGET_SAMPLE uniforms (for the torch baseline)
    out: SampleOut


def build_problem(spec: BenchSpec, device: torch.device, rotate_bytes: float = 2e8) -> Problem:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(spec.rows, spec.vocab, generator=g) * 3.0  # logits of a peaked-ish LM
    n_copies = max(2, int(rotate_bytes // x.numel() // 4))
    copies = [x.to(device)] + [x.to(device).roll(i, 1) for i in range(1, n_copies)]
    pos = torch.arange(spec.rows, dtype=torch.int64) + 1000
    params = SamplingDefaults()
    u = uniforms(SEED, pos, Purpose.TARGET_SAMPLE).to(device)
    out = SampleOut(torch.empty(spec.rows, dtype=torch.int64, device=device),
                    torch.empty(spec.rows, params.top_k, dtype=torch.int64, device=device),
                    torch.empty(spec.rows, params.top_k, dtype=torch.float32, device=device))
    return Problem(spec, params, copies, pos.to(device), u, out)


def kernel_call(pb: Problem, copy: int = 0, config: SamplerLaunch | None = None
                ) -> Callable[[], SampleOut]:
    x, spec = pb.copies[copy], pb.spec
    if not spec.tp_rank:
        return lambda: sample(x, pb.params, SEED, pb.positions, shards=spec.shards, out=pb.out,
                              config=config)
    V, N = spec.vocab, spec.shards
    bounds = [(int(s[0]), int(s[-1]) + 1) for s in torch.arange(V).tensor_split(N)]
    keys = torch.stack([topk_candidates(x[:, a:b], pb.params, a, V) for a, b in bounds],
                       dim=1)  # [R, N, KP]: what the all-gather delivers
    mine = x[:, bounds[0][0]: bounds[0][1]]  # rank 0's slice, a strided view

    def rank_step() -> SampleOut:
        topk_candidates(mine, pb.params, 0, V, config=config)
        return sample_from_candidates(keys, pb.params, SEED, pb.positions, vocab=V, out=pb.out,
                                      config=config)

    return rank_step


def torch_sample(x: torch.Tensor, params: SamplingDefaults, u: torch.Tensor):
    """The simplest torch formulation: tokens [R], kept probabilities [R, K], ids [R, K]."""
    z = x / params.temperature
    vals, ids = torch.topk(z, params.top_k, dim=1)  # [R, K] sorted descending
    p = torch.softmax(vals, dim=1)
    c = torch.cumsum(p, dim=1)
    p = torch.where(c - p < params.top_p, p, 0.0)  # keeps the token crossing top_p
    p = p / p.sum(dim=1, keepdim=True)
    c = torch.cumsum(p, dim=1)
    j = torch.searchsorted(c, (u * c[:, -1])[:, None], right=True).clamp_max(params.top_k - 1)
    return ids.gather(1, j)[:, 0], p, ids


def check_against_twin(pb: Problem) -> dict:
    got = kernel_call(pb)()
    torch.cuda.synchronize()
    tok, ids, probs = sample_ref(pb.copies[0], pb.params, SEED, pb.positions)
    g_tok, g_ids, g_probs = (t.cpu() for t in got)
    if not torch.equal(g_ids, ids) or not torch.equal(g_tok, tok):
        bad = [r for r in range(ids.shape[0])
               if not torch.equal(g_ids[r], ids[r]) or g_tok[r] != tok[r]]
        raise AssertionError(f"{pb.spec.name}: ids/tokens differ from the twin in rows {bad} "
                             "(run tests/kernels/test_sampler.py for the decision margins)")
    m = check(g_probs, probs, "kernels.sampler.probs", "fp32")
    t_tok, t_p, t_ids = (t.cpu() for t in torch_sample(pb.copies[0], pb.params, pb.u))
    same_kept = all(set(t_ids[r][t_p[r] > 0].tolist()) == set(ids[r][probs[r] > 0].tolist())
                    for r in range(ids.shape[0]))
    return dict(twin=str(m), torch_kept_sets_equal=same_kept,
                torch_tokens_equal=bool(torch.equal(t_tok, tok)))


def time_eager(fns: list[Callable], warmup: int, reps: int) -> float:
    """Median µs of fns[i % len(fns)]() over reps calls (one CUDA-event pair per call)."""
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))


def time_graph(fn: Callable, warmup: int, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        fn()
    return time_eager([graph.replay], warmup, reps)


LAUNCHES = {  # (tile, scan warps, merge warps, select) compared by --sweep
    f"{t}/{sw}/{mw}/{sel}": SamplerLaunch(t, sw, mw, sel)
    for t, sw, mw, sel in [(8192, 8, 4, "rounds"), (8192, 8, 4, "bitonic"),
                           (4096, 8, 4, "bitonic"), (2048, 4, 4, "bitonic"),
                           (1024, 4, 4, "bitonic"), (2048, 4, 8, "bitonic"),
                           (4096, 4, 4, "bitonic"),
                           # small tiles: many short scans, the merge gathers K of the groups
                           (4096, 8, 4, "rounds"), (2048, 4, 4, "rounds"),
                           (1024, 4, 4, "rounds"), (512, 4, 4, "rounds"),
                           (512, 2, 4, "rounds"), (256, 2, 4, "rounds"),
                           (256, 1, 4, "rounds"), (1024, 4, 8, "rounds")]
}


def sweep(warmup: int, reps: int) -> list[dict]:
    """Graph-replay time of each launch configuration on 8 × 160000 and on a TP8 rank's step,
    interleaved A/B/C… in rounds of reps/5 so drift hits every configuration alike; bits
    checked equal first."""
    return [r for spec in (SPECS[0], SPECS[3]) for r in sweep_spec(spec, warmup, reps)]


def sweep_spec(spec: BenchSpec, warmup: int, reps: int) -> list[dict]:
    pb = build_problem(spec, torch.device("cuda"))
    calls, want = {}, None
    for name, cfg in LAUNCHES.items():
        if triton.cdiv(spec.vocab // spec.shards, cfg.tile) > MAX_GROUPS:
            continue
        calls[name] = kernel_call(pb, 0, cfg)
        got = [t.clone() for t in calls[name]()]
        want = want or got
        if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            raise AssertionError(f"launch {name} changed the sampler's bits")
    times = {name: [] for name in calls}
    for _ in range(5):
        for name, fn in calls.items():
            times[name].append(time_graph(fn, warmup, max(1, reps // 5)))
    return [dict(spec=spec.name, launch=n, graph_us=statistics.median(t), rounds_us=t)
            for n, t in times.items()]


def run_spec(spec: BenchSpec, warmup: int, reps: int) -> dict:
    pb = build_problem(spec, torch.device("cuda"))
    checks = check_against_twin(pb)
    kern = [kernel_call(pb, i) for i in range(len(pb.copies))]
    base = [lambda x=x: torch_sample(x, pb.params, pb.u) for x in pb.copies]
    res = dict(spec=asdict(spec), params=asdict(pb.params), checks=checks)
    res["kernel_eager_us"] = time_eager(kern, warmup, reps)
    res["torch_eager_us"] = time_eager(base, warmup, reps)
    res["kernel_graph_us"] = time_graph(kern[0], warmup, reps)
    res["torch_graph_us"] = time_graph(base[0], warmup, reps)
    read = spec.rows * (spec.vocab // spec.shards if spec.tp_rank else spec.vocab) * 4
    res["logit_bytes"] = read
    res["kernel_eager_hbm_fraction"] = read / (res["kernel_eager_us"] * 1e-6) / HBM_BYTES_PER_S
    res["speedup_eager"] = res["torch_eager_us"] / res["kernel_eager_us"]
    res["speedup_graph"] = res["torch_graph_us"] / res["kernel_graph_us"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sweep", action="store_true",
                    help="compare the launch configurations of LAUNCHES on 8 x 160000 first")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sampler: needs a CUDA GPU", file=sys.stderr)
        return 2
    swept = sweep(args.warmup, args.reps) if args.sweep else []
    for r in swept:
        print(f"{r['spec']:32} launch {r['launch']:22} graph {r['graph_us']:7.1f} us  rounds "
              f"{', '.join(f'{t:.1f}' for t in r['rounds_us'])}")
    results = [run_spec(s, args.warmup, args.reps) for s in SPECS]
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(),
               triton=__import__("triton").__version__)
    head = f"{'case':34} {'kernel eager':>12} {'torch eager':>12} {'x':>6} " \
           f"{'kernel graph':>12} {'torch graph':>12} {'x':>6}"
    print(head)
    for r in results:
        print(f"{r['spec']['name']:34} {r['kernel_eager_us']:10.1f}us {r['torch_eager_us']:10.1f}us"
              f" {r['speedup_eager']:6.2f} {r['kernel_graph_us']:10.1f}us "
              f"{r['torch_graph_us']:10.1f}us {r['speedup_graph']:6.2f}")
    print("target: 8x160000 <= 20 us;", env)
    blob = json.dumps(dict(env=env, sweep=swept, results=results), indent=2)
    if args.json:
        args.json.write_text(blob)
    else:
        print(blob)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
