"""The QKV projection with qk_rope folded into its launch (kernels.qk_rope.qkv_rope) against the
two launches it replaces (kernels.linear.linear_fp8_partials, then kernels.qk_rope.qk_rope with
the KV write), at the per-rank TP8 shape of IQuest-Q1 (6 + 2 heads of 128 over H 3072, the
pinned tiles of 64 channels × 8 splits) on one GPU:

    python -m benchmarks.bench_qkv_rope --out DIR [--rows 1 6 8] [--layers 87] [--sets 3]

Each variant is a CUDA graph of `layers` calls, call j on its own weight copy (87 × 3.1 MB,
beyond the L2) and its own ring cache, x quantized once beforehand (in the runtime the previous
MoE tail quantizes it); the two graphs' replays alternate trial by trial (benchmarks/timing.py),
`sets` times over, each set a fresh pair of graphs — the spread of the sets is the uncertainty.
Before timing, the fused call's partials, q, k, v and cache are checked bit for bit against the
two launches at every row count (a mismatch raises).

Writes DIR/bench_qkv_rope.json (per-set medians, environment, command) and DIR/bench_qkv_rope.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.timing import time_graphs_alternating

HQ, HKV, D, ROT, HIDDEN, EPS = 6, 1, 128, 32, 3072, 1e-6


@dataclass(frozen=True)
class BenchConfig:
    rows: tuple[int, ...] = (1, 6, 8)  # live rows of an 8-row buffer
    layers: int = 87  # calls per graph, each on its own weights and cache
    sets: int = 3
    trials: int = 20
    warmup: int = 3

    def __post_init__(self) -> None:
        if not self.rows or not all(1 <= r <= 8 for r in self.rows):
            raise ValueError(f"--rows: live rows in [1, 8], got {self.rows}")
        if min(self.layers, self.sets, self.trials) < 1 or self.warmup < 0:
            raise ValueError("--layers, --sets, --trials must be >= 1, --warmup >= 0")


def _layers(cfg: BenchConfig, dev):
    from kernels.kv_cache import KVLayout, LayerKV
    from reference import ops

    gen = torch.Generator().manual_seed(0)
    lay = KVLayout.make_ring(4096 + 64, 4096, HKV, D)
    width = (HQ + 2 * HKV) * D
    out = []
    for _ in range(cfg.layers):
        w, s = ops.quantize_block(torch.randn(width, HIDDEN, generator=gen) / 16)
        k = torch.randn(lay.capacity, HKV, D, generator=gen).bfloat16()
        out.append(dict(w=w.to(dev), s=s.to(dev),
                        q_norm=(torch.rand(D, generator=gen) + 0.5).bfloat16().to(dev),
                        k_norm=(torch.rand(D, generator=gen) + 0.5).bfloat16().to(dev),
                        cache=LayerKV(lay, k.to(dev), k.clone().to(dev),
                                      torch.full((lay.capacity,), -1, dtype=torch.int32,
                                                 device=dev))))
    return out


def _variants(layers, x, xq, pos, n, table, dev):
    """{name: [call per layer]} over shared inputs and per-variant outputs."""
    from kernels.linear import linear_fp8_partials
    from kernels.qk_rope import QkvRopeScratch, qk_rope, qkv_rope

    width = (HQ + 2 * HKV) * D
    scratch = QkvRopeScratch.create(dev)
    args = dict(num_q_heads=HQ, num_kv_heads=HKV, eps=EPS)

    def bufs():
        return (torch.empty(8, 8, width, device=dev),
                dict(q_out=torch.empty(8, HQ, D, dtype=torch.bfloat16, device=dev),
                     k_out=torch.empty(8, HKV, D, dtype=torch.bfloat16, device=dev),
                     v_out=torch.empty(8, HKV, D, dtype=torch.bfloat16, device=dev)))

    p_two, o_two = bufs()
    p_one, o_one = bufs()

    def two(L):
        def call():
            linear_fp8_partials(x, L["w"], L["s"], n, quantized=xq, out=p_two)
            return (p_two, *qk_rope(p_two, L["q_norm"], L["k_norm"], pos, table, n,
                                    cache=L["cache"], **args, **o_two))
        return call

    def one(L):
        def call():
            return qkv_rope(x, L["w"], L["s"], L["q_norm"], L["k_norm"], pos, table, n,
                            scratch=scratch, quantized=xq, partials=p_one, cache=L["cache"],
                            **args, **o_one)
        return call

    return {"two launches": [two(L) for L in layers], "folded": [one(L) for L in layers]}


def _check(variants, layers, rows: int) -> None:
    """The folded call's results are the two launches' bits (caches compared after each)."""
    L = layers[0]
    before = (L["cache"].k.clone(), L["cache"].v.clone(), L["cache"].slot_pos.clone())
    want = [t.clone() for t in variants["two launches"][0]()]
    want_cache = (L["cache"].k.clone(), L["cache"].v.clone(), L["cache"].slot_pos.clone())
    for t, b in zip((L["cache"].k, L["cache"].v, L["cache"].slot_pos), before, strict=True):
        t.copy_(b)
    got = variants["folded"][0]()
    torch.cuda.synchronize()
    for name, a, b in zip(("partials", "q", "k", "v"), got, want, strict=True):
        a, b = (a[:, :rows], b[:, :rows]) if name == "partials" else (a[:rows], b[:rows])
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            raise SystemExit(f"bench_qkv_rope: {name} differs from the two launches at {rows} rows")
    for name, a, b in zip(("k", "v", "slot_pos"), (L["cache"].k, L["cache"].v,
                                                   L["cache"].slot_pos), want_cache, strict=True):
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            raise SystemExit(f"bench_qkv_rope: cache.{name} differs at {rows} rows")


def run(cfg: BenchConfig) -> dict:
    from kernels.fp8 import quantize_act
    from kernels.qk_rope import rope_table

    dev = torch.device("cuda")
    layers = _layers(cfg, dev)
    table = rope_table(8192, ROT, 1e6, dev)
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16().to(dev)
    pos = torch.arange(5000, 5008, dtype=torch.int32, device=dev)
    results = []
    for rows in cfg.rows:
        n = torch.tensor([rows], dtype=torch.int32, device=dev)
        xq = quantize_act(x, n)
        variants = _variants(layers, x, xq, pos, n, table, dev)
        _check(variants, layers, rows)
        sets = [time_graphs_alternating(variants, cfg.layers, cfg.trials, cfg.warmup)
                for _ in range(cfg.sets)]
        results.append(dict(rows=rows, sets=sets))
        print(f"rows {rows}: " + "; ".join(f"{k} {v:.2f} µs" for k, v in sets[-1].items()),
              file=sys.stderr, flush=True)
    return dict(results=results)


def table_md(results: list[dict]) -> str:
    lines = ["| live rows | two launches µs per layer | folded µs per layer | folded ÷ two "
             "(median of sets, min–max) |", "| --- | --- | --- | --- |"]
    for r in results:
        two = [s["two launches"] for s in r["sets"]]
        one = [s["folded"] for s in r["sets"]]
        ratio = [b / a for a, b in zip(two, one, strict=True)]
        lines.append(f"| {r['rows']} | {statistics.median(two):.2f} | {statistics.median(one):.2f}"
                     f" | {statistics.median(ratio):.3f} ({min(ratio):.3f}–{max(ratio):.3f}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=list(BenchConfig.rows))
    ap.add_argument("--layers", type=int, default=BenchConfig.layers)
    ap.add_argument("--sets", type=int, default=BenchConfig.sets)
    ap.add_argument("--trials", type=int, default=BenchConfig.trials)
    args = ap.parse_args(argv)
    try:
        cfg = BenchConfig(tuple(args.rows), args.layers, args.sets, args.trials)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("bench_qkv_rope: needs a CUDA GPU")
    from iquestrt.report.provenance import code_identity

    res = run(cfg)
    env = dict(code=code_identity(), gpu=torch.cuda.get_device_name(0),
               torch=torch.__version__, config=asdict(cfg),
               command=" ".join(["python -m benchmarks.bench_qkv_rope", *sys.argv[1:]]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_qkv_rope.json").write_text(json.dumps({**env, **res}, indent=1))
    code = env["code"]
    md = (f"# QKV + qk_rope: one folded launch vs two — {env['gpu']}\n\n"
          f"Commit {code.get('commit')} ({len(code.get('dirty') or [])} files changed in the "
          f"tree), source digest {code.get('source_digest', '?')[:16]}, torch {env['torch']}. "
          f"Command: `{env['command']}`. "
          f"{cfg.layers} layers per graph, {cfg.sets} sets of {cfg.trials} alternating trials."
          f"\n\n{table_md(res['results'])}\n")
    (args.out / "bench_qkv_rope.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
