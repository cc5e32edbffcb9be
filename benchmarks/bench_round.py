"""Benchmark of the decode engine's rounds (GPU): per draft depth policy (fixed D: verification
width D + 1; or adaptive), eager launches vs CUDA-graph replay by the host loop vs the device
loop (a WHILE graph node), on a checkpoint (default: a tiny-preset checkpoint with a correlated
draft, built in a temporary directory). Per configuration: rounds, tokens per round, time per
round and per output token, launches per round (CUDA kernels and memcpy/memset of one eager
round under torch.profiler, run on the finished request's state: 0 live rows launch the same
kernels), and the CUDA operations the decode loop executed per round (profiled over a whole
request: kernels inside graphs and IF nodes counted, depths an IF node skipped not).

Timing: the request's decode loop only (prefill, loading and capture excluded): wall time
between synchronizations around the engine's loop phase (LoopProbe), median of --reps requests,
configurations interleaved per repetition.

    python3 -m benchmarks.bench_round [--depths 3 4 5 6 7] [--modes eager graph device]
        [--tokens 128] [--reps 3] [--sync-rounds 8] [--json F]

The host loop reads the log every --sync-rounds rounds (default 8), the device loop once per
request; "device/graph" is the paired ratio of their round times (same run, alternating), and
the host loop's extra time is split into its over-run rounds (replays launched past the
request's end) and the gap per log read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from iquestrt.config import RuntimeConfig
from iquestrt.engine import Engine
from iquestrt.engine_parts import EngineObserver, EngineParts
from iquestrt.round import RoundProgram
from iquestrt.weights import from_checkpoint
from reference.checkpoint import load_checkpoint
from reference.config import SamplingDefaults
from reference.correlated import make_ckpt
from reference.depth import policy_from_spec
from reference.speculative import GenerationRequest

PROMPT = tuple(range(5, 69))
MODES = ("eager", "graph", "device")


class LoopProbe(EngineObserver):
    """The benchmark's observer of an engine's phases: while armed ("time" or "profile") it
    wraps the next request's launcher in a CountingLauncher and times, or profiles, its decode
    loop; unarmed it changes nothing."""

    def __init__(self):
        self.mode: str | None = None
        self.box: dict = {}
        self.counted: CountingLauncher | None = None

    def prepare(self, eng, st, run):
        launcher = run()
        if self.mode != "time":
            return launcher
        self.counted = CountingLauncher(launcher)
        return self.counted

    def loop(self, eng, st, launch_rounds) -> None:
        if self.mode is None:
            return launch_rounds()
        torch.cuda.synchronize()
        if self.mode == "profile":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                launch_rounds()
                torch.cuda.synchronize()
            self.box["n"] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
            return None
        t0 = time.perf_counter()
        launch_rounds()
        torch.cuda.synchronize()
        self.box["t"] = time.perf_counter() - t0
        return None

    def run(self, eng: Engine, req: GenerationRequest, mode: str):
        self.mode, self.box = mode, {}
        try:
            return eng.generate(req)
        finally:
            self.mode = None


def probed_engine(weights, rc: RuntimeConfig) -> tuple[Engine, LoopProbe]:
    probe = LoopProbe()
    return Engine(weights, rc, parts=EngineParts.default(weights, rc).with_observers(probe)), probe


def timed_request(eng: Engine, probe: LoopProbe, req: GenerationRequest):
    """Wall time of the decode loop (prefill, state setup and capture excluded) → (seconds,
    result, log reads, rounds launched)."""
    res = probe.run(eng, req, "time")
    c = probe.counted
    return probe.box["t"], res, c.reads, c.launched if c.launched is not None else len(res.rounds)


class CountingLauncher:
    """Counts the host's launches (= log reads) and the rounds a host loop replays: it launches
    `rounds` graph replays per read, so up to rounds - 1 of them run after the request ended
    (they change nothing, but take time). A device loop's WHILE node stops at done (launched =
    None: the rounds committed)."""

    def __init__(self, inner):
        self.inner, self.reads, self.launched = inner, 0, 0
        if getattr(getattr(inner, "graph", None), "looping", False):
            self.launched = None

    def launch(self, first: int, rounds: int) -> None:
        self.reads += 1
        if self.launched is not None:
            self.launched += rounds
        self.inner.launch(first, rounds)


def host_gap(dev: dict, host: dict) -> str:
    """Splits the host loop's extra time into its over-run rounds (costed at the device loop's
    round time) and the rest, spread over its log reads: the host gap per read."""
    per_round = statistics.median(dev["raw_s"]) / dev["rounds"]
    extra = statistics.median(host["raw_s"]) - statistics.median(dev["raw_s"])
    over = host["launched_rounds"] - host["rounds"]
    gap = (extra - over * per_round) / host["reads"]
    return (f"host loop: {over} over-run rounds ≈ {over * per_round * 1e6:.0f} us, the rest "
            f"{(extra - over * per_round) * 1e6:.0f} us over {host['reads']} reads = "
            f"{gap * 1e6:.1f} us per read")


def launches_per_round(eng: Engine, req: GenerationRequest) -> int:
    from torch.profiler import ProfilerActivity, profile

    st = eng.session.device
    st.done.fill_(1)
    program = RoundProgram(eng, st, eng.rcfg.policy)
    program()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        program()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def loop_ops_per_round(eng: Engine, probe: LoopProbe, req: GenerationRequest) -> float:
    """CUDA operations executed per round by the request's decode loop (kernels inside graph
    launches and conditional nodes included; the log reads' copies too): unlike the eager
    program's launch count it sees the depths an IF node skipped."""
    res = probe.run(eng, req, "profile")
    return probe.box["n"] / len(res.rounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", nargs="+", default=["3", "4", "5", "6", "7"],
                    help="fixed depths and/or 'adaptive' (the checkpoint's depth_policy.json or "
                         "reference.depth.default_adaptive)")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="default: a tiny-preset checkpoint with a correlated draft")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sync-rounds", type=int, default=8,
                    help="host loop: rounds launched between log reads (1 = the seed's per-round "
                         "host round trip)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_round: needs a CUDA GPU", file=sys.stderr)
        return 2
    ck = load_checkpoint(args.checkpoint or make_ckpt(Path(tempfile.mkdtemp()) / "c",
                                                      "correlated"))
    req = GenerationRequest(PROMPT, args.tokens, SamplingDefaults(), 1)  # the model's
    engines = {}
    for d in args.depths:
        for mode in args.modes:
            policy = policy_from_spec(d, ck.directory)
            rc = RuntimeConfig(ops="kernels", device="cuda", ring_pad=8, max_positions=512,
                               policy=policy, graphs=mode != "eager", sync_rounds=args.sync_rounds,
                               loop="device" if mode == "device" else "host")
            engines[d, mode] = probed_engine(from_checkpoint(ck, "cuda", 512), rc)
            engines[d, mode][0].generate(req)  # JIT-compile everything first
    times = {k: [] for k in engines}
    results, counts = {}, {}
    for rep in range(args.reps):
        for k, (eng, probe) in engines.items():
            t, res, reads, launched = timed_request(eng, probe, req)
            times[k].append(t)
            results[k], counts[k] = res, (reads, launched)
        print(f"rep {rep + 1}/{args.reps} done", flush=True)
    rows = []
    for (d, mode), ts in times.items():
        res = results[d, mode]
        t = statistics.median(ts)
        n_r, n_tok = len(res.rounds), len(res.tokens) - 1
        eng, probe = engines[d, mode]
        launches = launches_per_round(eng, req)
        ops = loop_ops_per_round(eng, probe, req)
        rows.append(dict(depth=d, width=res.rounds and max(len(r.drafts) for r in res.rounds) + 1,
                         mode=mode, rounds=n_r, launches=launches, loop_ops=ops,
                         tokens_per_round=n_tok / n_r, round_us=t / n_r * 1e6,
                         token_us=t / n_tok * 1e6, raw_s=ts, reads=counts[d, mode][0],
                         launched_rounds=counts[d, mode][1]))
    print(f"{'D':>2} {'W':>2} {'mode':>6} {'rounds':>6} {'tok/rnd':>7} {'us/round':>9} "
          f"{'us/token':>9} {'launches':>8} {'ops/rnd':>8} {'reads':>5} {'ran':>4}")
    for r in rows:
        print(f"{r['depth']:>2} {r['width']:2d} {r['mode']:>6} "
              f"{r['rounds']:6d} {r['tokens_per_round']:7.2f} {r['round_us']:9.1f} "
              f"{r['token_us']:9.1f} {r['launches']:8d} {r['loop_ops']:8.1f} {r['reads']:5d} "
              f"{r['launched_rounds']:4d}")
    by = {(r["depth"], r["mode"]): r for r in rows}
    for d in args.depths:
        for a, b in (("graph", "eager"), ("device", "graph")):
            if (d, a) in by and (d, b) in by:
                ra, rb = by[d, a], by[d, b]
                same = "same tokens" if results[d, a].tokens == results[d, b].tokens else \
                    "TOKENS DIFFER"
                print(f"depth {d}: {a}/{b} round time ratio {ra['round_us'] / rb['round_us']:.3f}"
                      f" ({b} - {a} = {rb['round_us'] - ra['round_us']:+.1f} us/round; {same})")
                if (a, b) == ("device", "graph"):
                    print("  " + host_gap(ra, rb))
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())
    if args.json:
        args.json.write_text(json.dumps(dict(env=env, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
