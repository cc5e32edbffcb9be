"""Decode / verification attention on one TP8 rank of IQuest-Q1 (6 query heads, 1 KV head,
D 128): split-KV kernel + combine vs the simplest torch formulation, on an H200.

    python benchmarks/bench_attention.py [--json out.json] [--reps 50] [--config '{...}']
    pytest benchmarks/bench_attention.py        # pytest-benchmark entry (GPU only)

Cases: rows 1 / 6 / 8 × {full layer at 4K, 16K, 64K, 128K context (capacity 128K + 64, as a
runtime would allocate), sliding ring 4096 + 64}. Every case rotates over enough independent
caches that the KV bytes read per pass exceed 4× the 60 MB L2. Timing: CUDA events around one
pass over all caches (eager launches, and the same pass replayed as a CUDA graph), median of
`reps` passes, divided by the caches per pass. Bytes = K and V of every position in the call's
range [min over rows of the window start, max row position] (what the kernel must read),
reported against the measured 4.24 TB/s. Outputs are checked against the twin before timing.

Dimension letters: R rows, Hq/Hkv heads, D head dim, C slots, L keys in range.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from iquestrt.capture import graph_capture
from kernels.attention import AttentionConfig, attention, pick_config  # noqa: E402
from kernels.kv_cache import KVLayout, LayerKV  # noqa: E402
from qualification.tolerances import check  # noqa: E402
from reference.twins.attention import attention_ref  # noqa: E402

HQ, HKV, D = 6, 1, 128
SCALE = D**-0.5
HBM_BPS = 4.24e12  # measured H200 copy bandwidth (read + write)
L2_BYTES = 60e6
FULL_CAPACITY = 131072 + 64
CONTEXTS = (4096, 16384, 65536, 131072)
WIDTHS = (1, 6, 8)


@dataclass(frozen=True)
class Case:
    kind: str  # "full" or "ring"
    context: int  # committed positions before the round
    rows: int


@dataclass
class Result:
    case: Case
    caches: int
    bytes_read: int
    kernel_us: float
    kernel_graph_us: float
    torch_us: float
    tbps: float
    graph_tbps: float
    check: str


def _layout(kind: str) -> KVLayout:
    if kind == "ring":
        return KVLayout.make_ring(4096, 64, HKV, D)
    return KVLayout.make_full(FULL_CAPACITY, HKV, D)


def _range(layout: KVLayout, pos: torch.Tensor) -> tuple[int, int]:
    """[first, last] positions the call reads (the kernel's tile range, before tile rounding)."""
    hi = int(pos.max())
    if layout.window is None:
        return layout.start, hi
    return max(layout.start, int(pos.min()) - layout.window + 1), hi


def _fill(layout: KVLayout, n_end: int, gen: torch.Generator, dev) -> LayerKV:
    """A cache holding positions up to n_end − 1 (the last C of them for a ring), random bf16,
    labels set by plain indexing (the write kernel is not what is measured here)."""
    if not layout.ring and n_end > layout.capacity:
        raise ValueError(f"bench_attention: a full cache of {layout.capacity} slots cannot hold "
                         f"positions up to {n_end - 1} (context + rows); largest context "
                         f"{layout.capacity - 8} at 8 rows")
    cache = LayerKV.empty(layout, dev)
    lo = 0 if not layout.ring else max(0, n_end - layout.capacity)
    pos = torch.arange(lo, n_end, device=dev)
    slots = pos % layout.capacity if layout.ring else pos
    cache.k[slots] = torch.randn(len(pos), HKV, D, generator=gen, device=dev).to(torch.bfloat16)
    cache.v[slots] = torch.randn(len(pos), HKV, D, generator=gen, device=dev).to(torch.bfloat16)
    cache.slot_pos[slots] = pos.to(torch.int32)
    return cache


def torch_attention(q, cache: LayerKV, pos, sink, scale, lo: int, hi: int):
    """The simplest torch formulation: gather the key range [lo, hi] (host ints, as a runtime
    knows its lengths), append the sink as a key with a zero value, boolean mask, SDPA with
    GQA. q [R, Hq, D] → [R, Hq, D] bf16."""
    lay = cache.layout
    kp = torch.arange(lo, hi + 1, device=q.device)  # [L] key positions
    idx = kp % lay.capacity if lay.ring else kp
    k = torch.cat([sink[None], cache.k[idx]], 0)  # [1 + L, Hkv, D]
    v = torch.cat([torch.zeros_like(sink[None]), cache.v[idx]], 0)
    vis = (kp[None] <= pos[:, None]) & (kp[None] >= lo)
    if lay.window:
        vis &= kp[None] > pos[:, None] - lay.window
    mask = torch.cat([torch.ones_like(vis[:, :1]), vis], 1)  # [R, 1 + L]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask[None, None], scale=scale, enable_gqa=True,
    )  # [1, Hq, R, D]
    return o[0].transpose(0, 1)


def _time_pass(fn, n_items: int, reps: int) -> float:
    """Median µs per item of `fn()` (one pass over n_items), CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n_items)
    return statistics.median(times)


def run_case(case: Case, reps: int, config: AttentionConfig | None, seed: int = 0) -> Result:
    dev = torch.device("cuda")
    layout = _layout(case.kind)
    gen = torch.Generator(device=dev).manual_seed(seed)
    n_end = case.context + case.rows
    pos = torch.arange(case.context, n_end, dtype=torch.int32, device=dev)
    lo, hi = _range(layout, pos)
    bytes_read = (hi - lo + 1) * HKV * D * 2 * 2  # K and V, bf16
    n_caches = max(2, math.ceil(4 * L2_BYTES / bytes_read))
    caches = [_fill(layout, n_end, gen, dev) for _ in range(n_caches)]
    q = torch.randn(case.rows, HQ, D, generator=gen, device=dev).to(torch.bfloat16)
    sink = (4.0 * torch.randn(HKV, D, generator=gen, device=dev)).to(torch.bfloat16)
    n_live = torch.tensor([case.rows], dtype=torch.int32, device=dev)
    outs = [torch.empty(case.rows, HQ, D, dtype=torch.bfloat16, device=dev) for _ in caches]

    out = attention(q, caches[0], pos, n_live, sink, SCALE, out=outs[0], config=config).clone()
    twin = attention_ref(q, caches[0], pos, case.rows, sink, SCALE, out_dtype=torch.float32)
    margin = check(out.float().cpu(), twin.cpu(), "kernels.attention", "bf16")
    base = torch_attention(q, caches[0], pos, sink, SCALE, lo, hi)
    torch_err = ((base.float().cpu() - twin.cpu()).abs().max() / twin.abs().max()).item()

    def kernel_pass():
        for c, o in zip(caches, outs, strict=True):
            attention(q, c, pos, n_live, sink, SCALE, out=o, config=config)

    def torch_pass():
        for c in caches:
            torch_attention(q, c, pos, sink, SCALE, lo, hi)

    for fn in (kernel_pass, torch_pass):
        fn()
    torch.cuda.synchronize()
    kernel_us = _time_pass(kernel_pass, n_caches, reps)
    torch_us = _time_pass(torch_pass, n_caches, max(3, reps // 5))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel_pass()
        torch.cuda.synchronize()
        with graph_capture(graph, stream=stream):
            kernel_pass()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs[0], out), "graph replay differs from the eager launch"
    graph_us = _time_pass(graph.replay, n_caches, reps)
    return Result(
        case, n_caches, bytes_read, kernel_us, graph_us, torch_us,
        bytes_read / (kernel_us * 1e-6) / 1e12, bytes_read / (graph_us * 1e-6) / 1e12,
        f"{margin}; torch max_rel {torch_err:.2e}",
    )


def cases() -> list[Case]:
    out = [Case("full", c, r) for c in CONTEXTS for r in WIDTHS]
    out += [Case("ring", 2 * 4160 + 1000, r) for r in WIDTHS]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=Path("bench_attention.json"))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--config", type=str, default=None,
                    help="AttentionConfig fields as JSON, overriding the pinned config")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    config = AttentionConfig(**json.loads(args.config)) if args.config else None
    rows = []
    hdr = (f"{'case':<22}{'caches':>7}{'MB read':>9}{'eager µs':>10}{'graph µs':>10}"
           f"{'torch µs':>10}{'TB/s':>7}{'%HBM':>6}{'torch/graph':>12}")
    print(hdr)
    for case in cases():
        r = run_case(case, args.reps, config)
        cfg = config or pick_config(D, _layout(case.kind).capacity, case.kind == "ring")
        rows.append(asdict(r) | {"config": asdict(cfg)})
        name = f"{case.kind} {case.context // 1024}K R={case.rows}"
        print(f"{name:<22}{r.caches:>7}{r.bytes_read / 1e6:>9.2f}{r.kernel_us:>10.2f}"
              f"{r.kernel_graph_us:>10.2f}{r.torch_us:>10.1f}{r.graph_tbps:>7.2f}"
              f"{100 * r.graph_tbps * 1e12 / HBM_BPS:>6.0f}{r.torch_us / r.kernel_graph_us:>12.1f}")
        print(f"    check: {r.check}")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "hbm_bps": HBM_BPS, "results": rows}
    args.json.write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"wrote {args.json}")
    return 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [Case("full", 16384, 6), Case("ring", 9320, 8)],
                         ids=lambda c: f"{c.kind}{c.context}-R{c.rows}")
def test_bench_attention(benchmark, case):
    r = benchmark.pedantic(run_case, args=(case, 20, None), rounds=1, iterations=1)
    benchmark.extra_info.update(graph_us=r.kernel_graph_us, tbps=r.graph_tbps, check=r.check)
    assert r.kernel_graph_us > 0


if __name__ == "__main__":
    raise SystemExit(main())
