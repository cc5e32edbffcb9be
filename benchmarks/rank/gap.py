"""What stands between a measured rank round and its 1.5 × floor target (record.TARGET_RATIO),
from a record's per-kernel breakdown:

    python -m benchmarks.rank.gap reports/benchmarks/rank-h200/record.json [--context 1K]

Per kernel family: launches, CUDA time, the floor bytes it must move (the record's floor terms,
assigned to the family that reads them — an approximation stated in FAMILY_BYTES) and the time
those bytes take at the measured copy bandwidth. Two per-launch costs come from the same record:
the shortest kernel seen (its mean duration) and the graph's gap between kernels ((round −
Σ kernel time) ÷ launches). A family cannot be faster than max(its launches × (shortest kernel +
gap), its bytes ÷ bandwidth), so their sum bounds the round from below while the launch count
stays as it is; and the launches that fit the target's budget follow from the same costs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.rank.record import TARGET_RATIO

# floor term → the kernel family that reads those bytes. The draft's bytes are mostly its
# lm_head shard and eh_proj (BF16 GEMMs: "linear"); its experts and attention are a few %.
FAMILY_BYTES = {
    "experts": "moe", "attention": "linear", "dense": "linear", "lm_head": "linear",
    "draft": "linear", "routers": "tails", "reductions": "tails", "kv": "attention",
    "small": "rows",
}


@dataclass(frozen=True)
class FamilyGap:
    family: str
    launches: int
    time_s: float
    bytes: float
    bytes_s: float  # bytes ÷ bandwidth
    bound_s: float  # max(launches × per-launch cost, bytes_s)


@dataclass(frozen=True)
class Gap:
    context: str
    policy: str
    round_s: float
    floor_s: float
    launches: int
    kernel_s: float  # Σ kernel time of the profiled eager round
    shortest_s: float  # mean duration of the shortest kernel seen
    gap_s: float  # graph gap per launch: (round − Σ kernels) ÷ launches
    families: tuple[FamilyGap, ...]

    @property
    def per_launch_s(self) -> float:
        return self.shortest_s + self.gap_s

    @property
    def bound_s(self) -> float:
        return sum(f.bound_s for f in self.families)

    @property
    def target_s(self) -> float:
        return TARGET_RATIO * self.floor_s

    def launches_allowed(self) -> int:
        """Launches that fit the target once the bytes-bound families take their bytes' time."""
        heavy = sum(f.bytes_s for f in self.families if f.bytes_s > f.launches * self.per_launch_s)
        return max(0, int((self.target_s - heavy) / self.per_launch_s))


def gap_of(rec: dict, context: str = "1K") -> Gap:
    head = f"W{rec['spec']['headline_width']}"
    row = next((r for r in rec["configs"] if r.get("context_name") == context
                and r.get("policy") == head and "breakdown" in r), None)
    if row is None:
        raise ValueError(f"record: no {context} {head} configuration with a per-kernel breakdown "
                         "(run the sweep with --profile key or all)")
    bd, bw = row["breakdown"], rec["bandwidth"]
    shortest = min(t / n for n, t in bd["top_kernels"].values())
    launches = bd["launches"]
    gap = max(0.0, (row["round_s"] - bd["kernel_s"]) / launches)
    by_bytes: dict[str, float] = {}
    for term, b in row["floor_terms"].items():
        fam = FAMILY_BYTES.get(term)
        if fam is None:
            raise ValueError(f"record: floor term {term!r} has no family in FAMILY_BYTES")
        by_bytes[fam] = by_bytes.get(fam, 0.0) + b
    fams = []
    for fam, (n, t) in sorted(bd["by_family"].items(), key=lambda kv: -kv[1][1]):
        b = by_bytes.get(fam, 0.0)
        fams.append(FamilyGap(fam, n, t, b, b / bw, max(n * (shortest + gap), b / bw)))
    return Gap(context, head, row["round_s"], row["floor_s"], launches, bd["kernel_s"],
               shortest, gap, tuple(fams))


def markdown(g: Gap) -> str:
    us = 1e6
    lines = [f"## What stands between the round and {TARGET_RATIO} × floor ({g.context}, "
             f"{g.policy})", "",
             f"Round {g.round_s * 1e3:.2f} ms, floor {g.floor_s * 1e3:.2f} ms, target "
             f"{g.target_s * 1e3:.2f} ms; {g.launches} launches; shortest kernel "
             f"{g.shortest_s * us:.2f} µs, graph gap {g.gap_s * us:.2f} µs per launch.", "",
             "| family | launches | time µs | share | µs per launch | floor bytes MB | bytes at "
             "copy bandwidth µs | lower bound µs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in g.families:
        lines.append(f"| {f.family} | {f.launches} | {f.time_s * us:.0f} | "
                     f"{f.time_s / g.kernel_s:.1%} | {f.time_s / f.launches * us:.2f} | "
                     f"{f.bytes / 1e6:.0f} | {f.bytes_s * us:.0f} | {f.bound_s * us:.0f} |")
    lines += ["", f"Lower bound with this launch structure: **{g.bound_s * 1e3:.2f} ms = "
              f"{g.bound_s / g.floor_s:.2f} × floor** (each family at max(launches × "
              f"{g.per_launch_s * us:.2f} µs, its bytes at the copy bandwidth)). The "
              f"{TARGET_RATIO} × target leaves room for about **{g.launches_allowed()} "
              f"launches** of that cost once the bytes-bound families take their bytes' time "
              f"(now {g.launches}).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rank.gap", description=__doc__)
    p.add_argument("record", type=Path)
    p.add_argument("--context", default="1K")
    a = p.parse_args(argv)
    try:
        rec = json.loads(a.record.read_text())
        print(markdown(gap_of(rec, a.context)))
    except (OSError, ValueError, KeyError) as e:
        sys.stderr.write(f"gap: {a.record}: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
