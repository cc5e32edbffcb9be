"""Benchmark the residual + RMSNorm tails (kernels/tails.py) on one GPU at the real hidden size:
attention tail with and without the folded router (E 256, K 8, FP32 router 3 MB), and the MoE
tail, for 1 / 6 / 8 live rows of an 8-row buffer and N = 1 / 8 rank partials (target ≤ 5 µs),
against the simplest torch formulation of the same op in the same run.

    python -m benchmarks.bench_tails --json bench_tails.json
    python -m benchmarks.bench_tails --sweep        # also a few pinned launch configs
    python -m benchmarks.bench_tails --ab prefetch_w    # a TailLaunch flag off vs on,
                                                        # graphs alternating, attn+router

Each configuration is checked against its twin (reference/twins/tails.py) before any timing — a
wrong result raises. Timing: a CUDA graph of `reps` calls, median over `trials` replays (CUDA
events) after warm-up. Every call finds its partials written (no waiting: this measures the tail,
not a producer) and re-arms a spare [R, H] buffer, so the re-arm stores are paid. Router weights
cycle through `router_copies` copies (default 40 × 3 MB ≫ the 60 MB L2), as the 87 MoE layers'
routers stream from HBM in a decode round; partials and activations stay L2-resident, as they would
be right after their producer. The torch baseline has no readiness poll (torch cannot poll): it is
sum → norms → residual → (router GEMM, softmax, top-k, renormalize) as separate ops, in a graph.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from benchmarks.timing import capture_graph, time_graph, time_graphs_alternating  # noqa: F401

HBM_BYTES_PER_S = 4.24e12
EPS, FFN_SCALE = 1e-6, 0.53881590608
TARGET_US = 5.0


@dataclass(frozen=True)
class Spec:
    tail: str  # "attn" | "attn+router" | "moe"
    rows: int  # live rows (buffer 8)
    npart: int  # rank partials N
    hidden: int = 3072
    experts: int = 256
    top_k: int = 8
    buffer_rows: int = 8
    router_copies: int = 40
    seed: int = 0

    @property
    def router(self) -> bool:
        return self.tail == "attn+router"


@dataclass
class Problem:
    spec: Spec
    partials: torch.Tensor  # [N, R, H] fp32, written
    resid: torch.Tensor  # [R, H] bf16 (xn for attn, h for moe)
    norms: list[torch.Tensor]  # 2 × [H] bf16
    router_w: list[torch.Tensor]  # copies × [E, H] fp32
    n_live: torch.Tensor  # [1] int32
    flag: torch.Tensor  # [1] int32
    rearm: torch.Tensor  # [R, H] fp32 spare buffer
    scratch: object  # kernels.tails.RouterScratch | None
    chunks: object  # kernels.row_chunks.RowChunkScratch (the chunked rows' counters)


def build(spec: Spec, device) -> Problem:
    from kernels.row_chunks import RowChunkScratch
    from kernels.tails import RouterScratch

    gen = torch.Generator().manual_seed(spec.seed)
    n, r, h = spec.npart, spec.buffer_rows, spec.hidden
    a_int = torch.randint(-64, 65, (r, h), generator=gen)
    parts = torch.randint(-16, 17, (n, r, h), generator=gen)
    parts[-1] = a_int - parts[:-1].sum(0)
    dgen = torch.Generator(device).manual_seed(spec.seed + 1)
    copies = spec.router_copies if spec.router else 0
    return Problem(
        spec,
        (parts.float() / 16).to(device),
        torch.randn(r, h, generator=gen).bfloat16().to(device),
        [(1 + 0.05 * torch.randn(h, generator=gen)).bfloat16().to(device) for _ in range(2)],
        [torch.randn(spec.experts, h, generator=dgen, device=device) * 2 / h**0.5
         for _ in range(copies)],
        torch.tensor([spec.rows], dtype=torch.int32, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
        torch.full((r, h), float("nan"), device=device),
        RouterScratch.create(h, spec.experts, device) if spec.router else None,
        RowChunkScratch.create(device),
    )


def kernel_call(p: Problem, copy: int = 0, config=None, out=None, trace=None):
    """trace: [programs, SLOTS] int64 per-program timestamps (kernels/timeline.py)."""
    from kernels.tails import attn_tail, moe_tail

    s = p.spec
    if s.tail == "moe":
        return lambda: moe_tail(p.partials, p.resid, p.norms[0], p.n_live, p.flag, eps=EPS,
                                ffn_out_scale=FFN_SCALE, max_polls=1 << 20, rearm=p.rearm,
                                out=out, config=config, trace=trace, chunk_scratch=p.chunks)
    rw = p.router_w[copy % len(p.router_w)] if s.router else None
    return lambda: attn_tail(p.partials, p.resid, p.norms[0], p.norms[1], p.n_live, p.flag,
                             eps=EPS, attn_out_scale=1.0, max_polls=1 << 20, rearm=p.rearm,
                             router_w=rw, top_k=s.top_k if s.router else 0, scratch=p.scratch,
                             out=out, config=config, trace=trace, chunk_scratch=p.chunks)


def torch_call(p: Problem, copy: int = 0):
    """The simplest torch formulation (reference.ops on the device), live rows only."""
    from reference import ops

    s, n = p.spec, p.spec.rows
    rw = p.router_w[copy % len(p.router_w)] if s.router else None

    def run():
        acc = p.partials[:, :n].sum(0)  # FP32 (not in pinned order: torch's own reduction)
        if s.tail == "moe":
            x = (p.resid[:n].float() + acc.bfloat16().float() * FFN_SCALE).bfloat16()
            return ops.rms_norm(x, p.norms[0], EPS)
        an = ops.rms_norm(acc.bfloat16(), p.norms[0], EPS)
        h32 = p.resid[:n].float() + an.float()
        f_in = ops.rms_norm(h32.bfloat16(), p.norms[1], EPS)
        if rw is None:
            return f_in
        logits = ops.rms_norm(h32, p.norms[1], EPS) @ rw.t()
        w, ids = torch.softmax(logits, -1).topk(s.top_k, -1)  # topk: ties unspecified
        return f_in, w / w.sum(-1, keepdim=True), ids

    return run


def check_against_twin(p: Problem, config=None) -> dict:
    """One kernel call vs the CPU twin; raises AssertionError when wrong."""
    from qualification.tolerances import check
    from reference import ops
    from reference.op_types import AttnTailOut
    from reference.twins.tails import attn_tail_ref, moe_tail_ref

    s, n = p.spec, p.spec.rows
    cpu = lambda t: t.cpu()  # noqa: E731
    if s.tail == "moe":
        out = kernel_call(p, 0, config)()
        torch.cuda.synchronize()
        twin = moe_tail_ref(cpu(p.partials), cpu(p.resid), cpu(p.norms[0]), n, eps=EPS,
                            ffn_out_scale=FFN_SCALE)
        rep = {"xn": str(check(cpu(out.xn)[:n], twin.xn, "kernels.residual_norm.moe_tail",
                               "bf16"))}
    else:
        out = kernel_call(p, 0, config, out=None)()
        torch.cuda.synchronize()
        rw = cpu(p.router_w[0]) if s.router else None
        twin = attn_tail_ref(cpu(p.partials), cpu(p.resid), cpu(p.norms[0]), cpu(p.norms[1]),
                             n, eps=EPS, attn_out_scale=1.0, router_w=rw,
                             top_k=s.top_k if s.router else 0)
        assert isinstance(out, AttnTailOut)
        rep = {"h": str(check(cpu(out.h)[:n], twin.h, "kernels.residual_norm.exact", "bf16")),
               "f_in": str(check(cpu(out.f_in)[:n], twin.f_in,
                                 "kernels.residual_norm.attn_tail", "bf16"))}
        if s.router:
            logits = cpu(p.scratch.logits)[:n]
            w_own, ids_own = ops.route(logits, torch.eye(s.experts), s.top_k)
            check(cpu(out.ids)[:n], ids_own.int(), "kernels.router.ids", "int32")
            rep["weights"] = str(check(cpu(out.weights)[:n], w_own, "kernels.router.weights",
                                       "fp32"))
            r_in_twin = twin_router_input(p)
            rep["logits"] = str(check(logits, r_in_twin @ rw.t(), "kernels.router.logits",
                                      "fp32"))
    if p.flag.item() != 0:
        raise AssertionError("failure flag set on written partials")
    return rep


def twin_router_input(p: Problem) -> torch.Tensor:
    from reference.twins.tails import attn_tail_router_input_ref

    return attn_tail_router_input_ref(p.partials.cpu(), p.resid.cpu(), p.norms[0].cpu(),
                                      p.norms[1].cpu(), p.spec.rows, eps=EPS, attn_out_scale=1.0)


def must_move_bytes(s: Spec) -> int:
    """Partials read, residual read, outputs written, ring re-arm, router weights (+ handoff)."""
    n, h = s.rows, s.hidden
    b = 4 * s.npart * n * h + 2 * n * h + 2 * 2 * h + 4 * s.buffer_rows * h
    b += 2 * n * h * (1 if s.tail == "moe" else 2)
    if s.router:
        b += 4 * s.experts * h + 3 * 4 * n * h + n * s.top_k * 8
    return b


def bench_one(spec: Spec, reps: int, trials: int, warmup: int, config=None,
              with_torch: bool = True) -> dict:
    from kernels.tails import tail_launch

    dev = torch.device("cuda")
    p = build(spec, dev)
    cfg = config or tail_launch(spec.hidden, spec.experts if spec.router else 0)
    row = {**asdict(spec), "launch": asdict(cfg)}
    row.update(check_against_twin(p, cfg))
    calls = [kernel_call(p, j, cfg) for j in range(max(1, len(p.router_w)))]
    us = time_graph(calls, reps, trials, warmup)
    if p.flag.item() != 0:
        raise AssertionError("failure flag set during timing")
    moved = must_move_bytes(spec)
    row.update(kernel_us=us, within_target=us <= TARGET_US, must_move_KB=moved / 1e3,
               achieved_TBps=moved / us / 1e6)
    if with_torch:
        tcalls = [torch_call(p, j) for j in range(len(calls))]
        tus = time_graph(tcalls, reps, trials, warmup)
        row.update(torch_us=tus, torch_over_kernel=tus / us)
    del p
    torch.cuda.empty_cache()
    return row


def bench_ab(flag: str, spec: Spec, reps: int, trials: int, warmup: int) -> dict:
    """The attention tail with router at the pinned launch with TailLaunch.<flag> off and on, each
    checked against the twin, timed as CUDA graphs replayed alternately (A B B′ A′ …).
    packed_topk and group_finish exclude each other: weighing either, the other is off in both."""
    from kernels.tails import RouterScratch, tail_launch

    p = build(spec, torch.device("cuda"))
    base = tail_launch(spec.hidden, spec.experts)
    other = {"packed_topk": "group_finish", "group_finish": "packed_topk"}.get(flag)
    if other:
        base = replace(base, **{other: False})
    cfgs = {"off": replace(base, **{flag: False}), "on": replace(base, **{flag: True})}
    row = {**asdict(spec), "ab": flag}
    variants = {}
    for name, cfg in cfgs.items():
        # a scratch per variant: one waiting on r_in's NaN cannot follow one that leaves it
        # written (TailLaunch.count_ready; kernels/router.py)
        pv = replace(p, scratch=RouterScratch.create(spec.hidden, spec.experts, p.flag.device))
        row[f"check_{name}"] = check_against_twin(pv, cfg)
        variants[name] = [kernel_call(pv, j, cfg) for j in range(max(1, len(pv.router_w)))]
    row.update({f"{k}_us": v for k, v in
                time_graphs_alternating(variants, reps, trials, warmup).items()})
    if p.flag.item() != 0:
        raise AssertionError("failure flag set during timing")
    del p
    torch.cuda.empty_cache()
    return row


SWEEP = ({"num_warps": 4}, {"num_warps": 16})  # both tails
SWEEP_ROUTER = ({"block_e": 2}, {"block_e": 8}, {"block_k": 256}, {"block_k": 64},
                {"block_k": 512}, {"block_k": 512, "block_e": 2},
                {"block_k": 1024, "block_e": 2}, {"unroll_k": True},
                {"unroll_k": True, "block_k": 256}, {"unroll_k": True, "block_e": 2})


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6, 8])
    ap.add_argument("--npart", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tails", nargs="+", default=["attn", "attn+router", "moe"])
    ap.add_argument("--router-copies", type=int, default=40)
    ap.add_argument("--reps", type=int, default=50, help="calls per CUDA graph")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sweep", action="store_true",
                    help="also time a few pinned launch-config variants (6 rows, N = 8)")
    ap.add_argument("--ab", metavar="FLAG",
                    help="only: a TailLaunch flag off vs on (attn+router, --rows, --npart)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", type=Path, default=Path("bench_tails.json"))
    args = ap.parse_args(argv)
    from kernels.tails import tail_launch
    from kernels.tails_launch import TailLaunch

    flags = [f.name for f in fields(TailLaunch) if f.type in (bool, "bool")]
    if args.ab and args.ab not in flags:
        raise SystemExit(f"bench_tails: --ab {args.ab!r}: not a TailLaunch flag; one of "
                         f"{', '.join(flags)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_tails: needs a CUDA GPU")

    rows = []
    if args.ab:
        for npart in args.npart:
            for r in args.rows:
                row = bench_ab(args.ab, Spec("attn+router", r, npart,
                                             router_copies=args.router_copies),
                               args.reps, args.trials, args.warmup)
                rows.append(row)
                print(f"ab {args.ab} N={npart} rows={r}: off {row['off_us']:.2f} µs, "
                      f"on {row['on_us']:.2f} µs ({row['on_us'] - row['off_us']:+.2f})")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows}, indent=2, default=str))
        return rows
    for tail in args.tails:
        for npart in args.npart:
            for r in args.rows:
                spec = Spec(tail, r, npart, router_copies=args.router_copies)
                row = bench_one(spec, args.reps, args.trials, args.warmup,
                                with_torch=not args.no_torch)
                rows.append(row)
                print(f"{tail:>11} N={npart} rows={r}: {row['kernel_us']:.2f} µs"
                      + (f", torch {row['torch_us']:.1f} µs ({row['torch_over_kernel']:.1f}×)"
                         if "torch_us" in row else ""))
    if args.sweep:
        for tail in ("attn+router", "moe"):
            spec = Spec(tail, 6, 8, router_copies=args.router_copies)
            base = tail_launch(spec.hidden, spec.experts if spec.router else 0)
            for change in SWEEP + (SWEEP_ROUTER if tail == "attn+router" else ()):
                cfg = replace(base, **change)
                row = bench_one(spec, args.reps, args.trials, args.warmup, cfg, with_torch=False)
                row["sweep"] = change
                rows.append(row)
                print(f"sweep {tail} {change}: {row['kernel_us']:.2f} µs")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"{'tail':>11} {'N':>2} {'rows':>4} {'µs':>7} {'≤5µs':>5} {'KB':>7} {'TB/s':>5} "
          f"{'torch µs':>8} {'torch×':>6}  launch")
    for row in rows:
        print(f"{row['tail']:>11} {row['npart']:>2} {row['rows']:>4} {row['kernel_us']:>7.2f} "
              f"{'yes' if row['within_target'] else 'NO':>5} {row['must_move_KB']:>7.0f} "
              f"{row['achieved_TBps']:>5.2f} {row.get('torch_us', float('nan')):>8.1f} "
              f"{row.get('torch_over_kernel', float('nan')):>6.1f}  {row['launch']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str))
    print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
