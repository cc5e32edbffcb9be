"""Census of the torch ops a speculative round dispatches outside the op table: the round's glue
(iquestrt/round.py and the models' bodies), each of which is a kernel launch on a GPU. Counted on
the CPU with a TorchDispatchMode over the engine's loop phase, so it needs no GPU and no
profiler; the op table's own work (kernels or twins) is left out, as are host reads of the CPU
path (`RoundProgram._host_stop`) and the engine's log reads.

    python -m benchmarks.round_census                 # small rank, twins, depth 5, 6 rounds
    python -m benchmarks.round_census --ops kernels   # the same through the interpreted kernels

Prints a table: ops per round by (aten op, call site), then the total per round.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
# where the round's glue lives; an op dispatched with one of these frames innermost counts
GLUE = ("iquestrt/round.py", "iquestrt/model.py", "iquestrt/draft.py", "reference/depth.py")
# frames that mark an op as the op table's own (or a host read), not glue; the rank table's
# adapters and its trace-routing override are the benchmark's, not the runtime's
OWN = ("iquestrt/ops_twins.py", "iquestrt/ops_kernels.py", "reference/twins/", "kernels/",
       "benchmarks/rank/ops.py", "_host_stop", "qualification/lockstep.py")
# aten ops that launch nothing on a GPU (views, allocations, metadata)
NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "view", "_unsafe_view",
             "slice", "select", "as_strided", "expand", "unsqueeze", "squeeze", "t",
             "transpose", "permute", "detach", "alias", "reshape", "split", "unbind",
             "lift_fresh", "_local_scalar_dense", "scalar_tensor", "is_nonzero"}


class GlueCounter(TorchDispatchMode):
    """Counts (aten op, file:line function) of every launching op whose innermost repository
    frame is glue. The stack is walked frame by frame (code objects' file names and line
    numbers only: no source lines read, no Path built per frame) — the dispatch of every op of
    a round passes through here."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self._root = str(REPO) + "/"

    def _repo_frames(self) -> list[tuple[str, int, str]]:
        """(path relative to the repository, line, function) of the repository's frames on the
        stack, outermost first (the order traceback.extract_stack gives)."""
        out = []
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if name.startswith(self._root) and "/.nox/" not in name:
                out.append((name[len(self._root):], f.f_lineno, f.f_code.co_name))
            f = f.f_back
        out.reverse()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in NO_LAUNCH:
            return out
        rel = self._repo_frames()
        if any(any(o in path or o == fn for o in OWN) for path, _, fn in rel):
            return out
        for path, line, fn in reversed(rel):
            if path in GLUE:
                self.counts[(name, f"{path}:{line} {fn}")] += 1
                break
        return out


def census(ops: str = "twins", depth: int = 5, rounds: int = 6, context: int = 150
           ) -> tuple[collections.Counter, int]:
    """(counts by (op, site) over the loop phase, rounds run) for one request on the small rank
    (benchmarks/rank/shapes.py) with a fixed draft depth."""
    from benchmarks.rank.engine import RankEngine
    from benchmarks.rank.shapes import small_rank_config
    from benchmarks.rank.traces import uniform_table
    from benchmarks.rank.weights import random_weights
    from iquestrt.config import RuntimeConfig
    from iquestrt.engine_parts import EngineObserver
    from reference.depth import FixedDepth

    cfg = small_rank_config()
    t = cfg.target
    table = uniform_table(32, t.num_hidden_layers - 1, 8, t.num_experts, t.num_experts_per_tok,
                          0).ids
    rc = RuntimeConfig(ops=ops, device="cpu", max_width=8, ring_pad=64, max_positions=512,
                       policy=FixedDepth(depth), prefetch=False)
    eng = RankEngine(random_weights(cfg, "cpu", 0, 512), rc, table, seed=1, peers=7)
    counter = GlueCounter()

    class _Count(EngineObserver):
        def loop(self, engine, st, run):
            with counter:
                return run()

    eng.parts = dataclasses.replace(eng.parts, observers=(*eng.parts.observers, _Count()))
    res = eng.generate(eng.request(context, rounds))
    return counter.counts, len(res.rounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="twins", choices=("twins", "kernels"))
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    if args.rounds < 2 or args.depth < 0:
        ap.error(f"--rounds {args.rounds} --depth {args.depth}: the request needs --rounds >= 2 "
                 "(its first token comes from the prefill, not from a round) and --depth >= 0")
    counts, n = census(args.ops, args.depth, args.rounds)
    if n == 0:
        raise SystemExit(f"round_census: the request ended before a speculative round ran "
                         f"(--rounds {args.rounds}); nothing to count")
    print(f"{'per round':>9}  {'aten op':<20} site")
    for (name, site), k in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{k / n:9.2f}  {name:<20} {site}")
    print(f"{sum(counts.values()) / n:9.2f}  total per round ({n} rounds, depth {args.depth}, "
          f"ops {args.ops})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
