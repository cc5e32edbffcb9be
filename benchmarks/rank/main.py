"""`python -m benchmarks.rank` / `iquestrt bench round`: arguments, checks, and the run.

    python -m benchmarks.rank --out reports/benchmarks/rank-h200 [--quick]
        [--widths 4 5 6 7 8] [--no-adaptive] [--contexts 1K 4K 16K 64K 128K 192K]
        [--rounds 32] [--reps 1] [--baseline all|eager|compile|none] [--routing traces|uniform]

Widths are verification rows per round (fixed draft depth = width − 1); the engine's row buffer
is always 8 (one compiled kernel set and one graph shape family). Needs a CUDA GPU: without one
it exits with status 2 and says so, before any work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.rank.spec import (
    BASELINES,
    CONTEXTS,
    BenchArgsError,
    SweepSpec,
)

EXIT_USAGE = 2
EXIT_FAILED = 1  # the record is written, with the failed parts' errors


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SweepSpec()
    p.add_argument("--out", type=Path, required=True, help="output folder (replaced atomically)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: context 1K, width 6, no adaptive, eager baseline only")
    p.add_argument("--widths", type=int, nargs="+", default=list(d.widths),
                   help="verification widths 4..8 (fixed draft depth = width − 1)")
    p.add_argument("--no-adaptive", action="store_true", help="skip the adaptive-depth policy")
    p.add_argument("--contexts", nargs="+", default=list(d.contexts),
                   help=f"contexts, from {list(CONTEXTS)}")
    p.add_argument("--rounds", type=int, default=d.rounds, help="token budget per timed request")
    p.add_argument("--reps", type=int, default=d.reps, help="timed requests per configuration")
    p.add_argument("--baseline", default=d.baseline,
                   help=f"BF16 torch baseline variants: {list(BASELINES)}")
    p.add_argument("--baseline-rounds", type=int, default=d.baseline_rounds)
    p.add_argument("--routing", default=d.routing, help="traces (mini model) or uniform")
    p.add_argument("--mapping", default=d.mapping, help="trace mapping: primary or position")
    p.add_argument("--profile", default=d.profile, help="per-kernel breakdown: all, key, none")
    p.add_argument("--no-eager", action="store_true", help="skip the eager-launch timing")
    p.add_argument("--loop", default=d.loop,
                   help="graph runs: host (one replay per round; per-round events) or device "
                        "(a WHILE graph node runs the request; round = loop time / rounds)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--reduce", default=None,
                   help="stacked (default on one GPU): tails read [S + 7, R, H]; table: through "
                        "an address table with the 7 peers in their own allocations and a re-arm "
                        "per tail (what --tp-reduce peer costs a rank); ring (default with --tp): "
                        "the real ring over the --tp processes")
    p.add_argument("--tp", type=int, default=d.tp,
                   help="N processes under torchrun (one GPU each), every one a TP8 rank: the "
                        "target's reductions go through a real peer-memory ring over the N GPUs "
                        "plus 8 − N emulated ranks; rank 0 writes the record")
    p.add_argument("--pdl", default=d.pdl,
                   help="programmatic dependent launch of the kernels (kernels/launch.py): auto "
                        "(the runtime's default: on where it can run), off, on, or ab (each "
                        "configuration both ways, the runs alternating; rows '+pdl' and their "
                        "ratio)")
    p.add_argument("--launch", action="append", default=[], metavar="OVERRIDES",
                   help="a variant with the kernels' launch configurations overridden, run "
                        "beside each configuration (alternating; rows '<policy>+OVERRIDES' and "
                        "their ratio), e.g. moe.down_rows=1, attention.num_stages=4 or "
                        "sampler.tile=2048,sampler.scan_warps=4 (iquestrt/launch_overrides.py: "
                        "families moe, sampler, tails, qkv, linear, attention); repeatable")


def spec_from_args(a: argparse.Namespace) -> SweepSpec:
    tp = getattr(a, "tp", 1)
    reduce = getattr(a, "reduce", None) or ("ring" if tp != 1 else "stacked")
    common = dict(routing=a.routing, mapping=a.mapping, loop=a.loop, seed=a.seed, reduce=reduce,
                  pdl=a.pdl, tp=tp, launch=tuple(getattr(a, "launch", ())))
    if a.quick:
        return SweepSpec(widths=(6,), adaptive=False, contexts=("1K",), rounds=16, reps=1,
                         baseline="eager" if a.baseline == "all" else a.baseline,
                         baseline_rounds=3, profile="key" if a.profile != "none" else "none",
                         eager=False, **common)
    return SweepSpec(widths=tuple(a.widths), adaptive=not a.no_adaptive,
                     contexts=tuple(a.contexts), rounds=a.rounds, reps=a.reps,
                     baseline=a.baseline, baseline_rounds=a.baseline_rounds, profile=a.profile,
                     eager=not a.no_eager, **common)


def run_from_args(a: argparse.Namespace, prog: str = "python -m benchmarks.rank") -> int:
    spec = spec_from_args(a)  # argument errors first, before any device check
    import os

    import torch

    world = os.environ.get("WORLD_SIZE", "1")
    if world != str(spec.tp):
        raise BenchArgsError(f"--tp {spec.tp}: {world} processes (WORLD_SIZE); start it as "
                             f"torchrun --nproc-per-node {spec.tp} -m benchmarks.rank --tp "
                             f"{spec.tp} … (one GPU per process)")
    if not torch.cuda.is_available():
        sys.stderr.write("bench round: needs a CUDA GPU (one H200 holds a TP8 rank: ~41 GB of "
                         "E4M3 weights); torch.cuda.is_available() is False here\n")
        return EXIT_USAGE
    if spec.tp > 1 and spec.tp > torch.cuda.device_count():
        sys.stderr.write(f"bench round: --tp {spec.tp} needs a GPU per process; "
                         f"{torch.cuda.device_count()} visible here\n")
        return EXIT_USAGE
    from benchmarks.rank.shapes import rank_config
    from benchmarks.rank.sweep import Rig, run_sweep

    command = " ".join([prog, *sys.argv[1:]])
    if spec.tp == 1:
        record = run_sweep(spec, a.out, command)
    else:
        from iquestrt.tp import group as tp_group

        g = tp_group.init_group()  # the torchrun environment; multicast switched off first
        record = run_sweep(spec, a.out, command, Rig(rank_config(), device=str(g.device)), g)
        tp_group.close_group()
    failed = failures(record)
    if failed:
        sys.stderr.write(f"bench round: {len(failed)} part(s) failed (recorded with their errors "
                         f"in {a.out}): {', '.join(failed)}\n")
        return EXIT_FAILED
    return 0


def failures(record: dict) -> list[str]:
    """Names of the timed parts that raised: configurations and the eager run. (A baseline
    variant that does not compile is a result: the compiled baseline is timed where it
    compiles.)"""
    out = [f"{r['context_name']} {r['policy']}" for r in record["configs"] if "error" in r]
    if isinstance(record.get("eager"), dict) and "error" in record["eager"]:
        out.append("eager")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rank",
                                description=__doc__.split("\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    try:
        return run_from_args(a)
    except BenchArgsError as e:
        sys.stderr.write(f"bench round: error: {e}\n")
        return EXIT_USAGE
