"""Launch-config sweep for the split-KV attention on one TP8 rank (6 q heads, 1 KV head, D 128).

    python -m benchmarks.sweep_attention --json sweep.json

For each candidate AttentionConfig and case: check the output against the twin, then time the
whole call (split + combine) and the split kernel alone as CUDA-graph replays over rotating
caches (working set > 4x L2); the combine's share is the difference. Prints a table sorted by
case and time. Used to choose the pinned configs in kernels/attention/::pick_config.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import (  # noqa: E402
    HBM_BPS,
    HKV,
    HQ,
    L2_BYTES,
    SCALE,
    Case,
    D,
    _fill,
    _layout,
    _range,
    _time_pass,
)
from iquestrt.capture import graph_capture
from kernels.attention import (  # noqa: E402
    AttentionConfig,
    attention,
    attention_split,
    pick_config,
)
from qualification.tolerances import check  # noqa: E402
from reference.twins.attention import attention_ref  # noqa: E402


def _graph(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with graph_capture(g):
        fn()
    return g


def build(case: Case) -> dict:
    """Rotating caches and inputs for one case (shared by every config)."""
    dev = torch.device("cuda")
    layout = _layout(case.kind)
    gen = torch.Generator(device=dev).manual_seed(0)
    n_end = case.context + case.rows
    pos = torch.arange(case.context, n_end, dtype=torch.int32, device=dev)
    lo, hi = _range(layout, pos)
    nbytes = (hi - lo + 1) * HKV * D * 4
    n = max(2, math.ceil(4 * L2_BYTES / nbytes))
    return {
        "caches": [_fill(layout, n_end, gen, dev) for _ in range(n)],
        "q": torch.randn(case.rows, HQ, D, generator=gen, device=dev).to(torch.bfloat16),
        "sink": (4.0 * torch.randn(HKV, D, generator=gen, device=dev)).to(torch.bfloat16),
        "n_live": torch.tensor([case.rows], dtype=torch.int32, device=dev),
        "pos": pos, "nbytes": nbytes,
    }


def time_config(case: Case, b: dict, cfg: AttentionConfig, reps: int) -> dict:
    caches, q, sink, n_live, pos = b["caches"], b["q"], b["sink"], b["n_live"], b["pos"]
    n, nbytes = len(caches), b["nbytes"]
    outs = [torch.empty_like(q) for _ in caches]
    out = attention(q, caches[0], pos, n_live, sink, SCALE, out=outs[0], config=cfg)
    twin = attention_ref(q, caches[0], pos, case.rows, sink, SCALE, out_dtype=torch.float32)
    margin = check(out.float().cpu(), twin.cpu(), "kernels.attention", "bf16")

    def full():
        for c, o in zip(caches, outs, strict=True):
            attention(q, c, pos, n_live, sink, SCALE, out=o, config=cfg)

    def split_only():
        for c in caches:
            attention_split(q, c, pos, n_live, SCALE, config=cfg)

    g_full, g_split = _graph(full), _graph(split_only)
    us = _time_pass(g_full.replay, n, reps)
    split_us = _time_pass(g_split.replay, n, reps)
    return {"case": asdict(case), "config": asdict(cfg), "us": us, "split_us": split_us,
            "combine_us": us - split_us, "tbps": nbytes / us / 1e6,
            "hbm": nbytes / (us * 1e-6) / HBM_BPS, "check": str(margin)}


def candidates(kind: str) -> list[AttentionConfig]:
    out = []
    splits = (16, 32, 66) if kind == "ring" else (66, 132, 264)
    pinned = pick_config(D, _layout(kind).capacity, kind == "ring")  # its combine for every row
    for block_n, ns, stages, warps in itertools.product((64, 128), splits, (2, 3), (4, 8)):
        out.append(dataclasses.replace(pinned, block_n=block_n, num_splits=ns,
                                       min_tiles_per_split=2, num_warps=warps,
                                       num_stages=stages))
    return out


def combine_candidates(kind: str) -> list[AttentionConfig]:
    """Second pass: the best split shapes of the first pass × combine trip size and warps."""
    splits = ((64, 66, 3),) if kind == "ring" else ((64, 132, 3), (64, 264, 3))
    return [
        AttentionConfig(block_n=bn, num_splits=ns, min_tiles_per_split=2, num_warps=4,
                        num_stages=st, combine_heads=1, combine_splits=sb, combine_warps=cw)
        for (bn, ns, st), sb, cw in itertools.product(splits, (16, 32, 64, 128), (4, 8))
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=Path("sweep_attention.json"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--combine", action="store_true", help="second pass: combine batching")
    a = ap.parse_args(argv)
    pick = combine_candidates if a.combine else candidates
    cases = [Case("full", 65536, 6), Case("full", 131072, 6), Case("ring", 2 * 4160 + 1000, 6)]
    if a.combine:
        cases.insert(0, Case("full", 1024, 6))
    else:
        cases.insert(0, Case("full", 4096, 6))
    rows = []
    for case in cases:
        bufs = build(case)
        for cfg in pick(case.kind):
            try:
                r = time_config(case, bufs, cfg, a.reps)
            except Exception as e:  # a config that does not compile or fits no shared memory
                r = {"case": asdict(case), "config": asdict(cfg), "error": repr(e)[:200]}
            rows.append(r)
            c = r["config"]
            tag = (f"{case.kind} {case.context // 1024}K bn{c['block_n']} s{c['num_splits']} "
                   f"st{c['num_stages']} w{c['num_warps']} sb{c['combine_splits']} "
                   f"cw{c['combine_warps']} hb{c['combine_heads']}")
            if "error" in r:
                print(f"{tag:<36} ERROR {r['error']}", flush=True)
            else:
                print(f"{tag:<36} {r['us']:7.2f} µs (split {r['split_us']:6.2f}) "
                      f"{r['tbps']:5.2f} TB/s {100 * r['hbm']:4.0f}%", flush=True)
    a.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
