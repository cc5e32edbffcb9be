"""Benchmark kernels.linear at the per-rank TP8 shapes of IQuest-Q1 on one GPU, against the HBM
floor and the simplest torch formulations.

    python -m benchmarks.bench_linear --rows 1 6 8 --out bench_linear.json
    python -m benchmarks.bench_linear --sweep --rows 6 --out sweep.json   # candidate configs
    python -m benchmarks.bench_linear --no-torch --variant hoist_scales=1   # pinned vs variant

Shapes (N, K): QKV 1024×3072, O 3072×768, dense gate (= up) 1536×3072, gate+up fused
3072×3072, down 3072×1536 (block FP8, bf16 out), lm_head 20000×3072 (BF16, FP32 logits).
Rows: an 8-row buffer with n_live = rows. Each shape is first checked against its twin
(reference/twins/linear.py) under its tolerance row — a wrong result raises before any timing.
Timing: a CUDA graph of `reps` calls cycling through enough weight copies that the bytes cycled
exceed 2 × L2 (60 MB), so every call streams its weights from HBM; median over `trials` graph
replays (CUDA events) after warm-up. Bytes that must move: weights (+ FP32 block scales) + x read
+ y written; achieved bandwidth vs 4.24 TB/s (the H200's measured copy bandwidth). Split-K
partials (written and read once more, ≤ 10% of the weight bytes here) are reported apart.
Torch baselines in the same run: `torch_deq` dequantizes W to bf16 and multiplies (the simplest
formulation of the FP8 op), `torch_bf16` multiplies a pre-dequantized bf16 W (2× the bytes: what
cuBLAS does without FP8); the lm_head baseline is F.linear in bf16.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.launch_variant import parse_variant
from benchmarks.timing import capture_graph, time_graph, time_graphs_alternating  # noqa: F401

HBM_BYTES_PER_S = 4.24e12
L2_BYTES = 60e6


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    k: int
    fp8: bool = True


SHAPES = (
    ("qkv", Shape("qkv", 1024, 3072)),
    ("o", Shape("o", 3072, 768)),
    ("gate", Shape("gate", 1536, 3072)),
    ("gate_up", Shape("gate_up", 3072, 3072)),
    ("down", Shape("down", 3072, 1536)),
    ("lm_head", Shape("lm_head", 20000, 3072, fp8=False)),
)


def weight_bytes(s: Shape) -> int:
    if not s.fp8:
        return 2 * s.n * s.k
    return s.n * s.k + 4 * math.ceil(s.n / 128) * math.ceil(s.k / 128)


def must_move_bytes(s: Shape, rows: int) -> int:
    out_bytes = 2 if s.fp8 else 4
    return weight_bytes(s) + 2 * rows * s.k + out_bytes * rows * s.n


@dataclass
class Problem:
    shape: Shape
    rows: int
    x: torch.Tensor  # [8, K] bf16
    weights: list[torch.Tensor]  # per copy [N, K] E4M3 or bf16
    scales: list[torch.Tensor | None]  # per copy [⌈N/128⌉, ⌈K/128⌉] fp32
    n_live: torch.Tensor  # [1] int32
    out: torch.Tensor  # [8, N]
    config: object = None  # LinearLaunch or None (pinned)

    def kernel_call(self, copy: int, config=None):
        """config: a LinearLaunch for this call instead of the problem's (FP8 shapes)."""
        from kernels.linear import linear_bf16_f32, linear_fp8

        c = copy % len(self.weights)
        if self.shape.fp8:
            from kernels.linear import linear_fp8_launch, linear_fp8_splits

            cfg = config or self.config or linear_fp8_launch(self.shape.n, self.shape.k)
            s = linear_fp8_splits(self.shape.n, self.shape.k, cfg)
            part = torch.empty(s, 8, self.shape.n, device=self.x.device) if s > 1 else None
            return lambda: linear_fp8(self.x, self.weights[c], self.scales[c], self.n_live,
                                      out=self.out, partials=part, config=cfg)
        return lambda: linear_bf16_f32(self.x, self.weights[c], self.n_live, out=self.out,
                                       config=self.config)

    def kernel_calls(self, config=None):
        return [self.kernel_call(j, config) for j in range(len(self.weights))]


def build_problem(shape: Shape, rows: int, copies: int | None, device, config=None) -> Problem:
    gen = torch.Generator(device).manual_seed(1234)
    if copies is None:
        copies = max(2, math.ceil(2 * L2_BYTES / weight_bytes(shape)))
    x = torch.randn(8, shape.k, generator=gen, device=device).bfloat16()
    weights, scales = [], []
    for _ in range(copies):
        w = torch.randn(shape.n, shape.k, generator=gen, device=device)
        if shape.fp8:
            weights.append((w * 16).clamp(-448, 448).to(torch.float8_e4m3fn))
            scales.append(torch.rand(math.ceil(shape.n / 128), math.ceil(shape.k / 128),
                                     generator=gen, device=device) * 1e-3 + 1e-4)
        else:
            weights.append((w * 0.02).bfloat16())
            scales.append(None)
    out = torch.empty(8, shape.n, dtype=torch.bfloat16 if shape.fp8 else torch.float32,
                      device=device)
    n = torch.tensor([rows], dtype=torch.int32, device=device)
    return Problem(shape, rows, x, weights, scales, n, out, config)


def torch_calls(p: Problem) -> dict[str, list]:
    """Per baseline, one call per weight copy."""
    r = p.rows
    if not p.shape.fp8:
        fl = torch.nn.functional.linear
        return {"torch_bf16": [lambda w=w: fl(p.x[:r], w) for w in p.weights]}

    def deq(w, s):
        full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        return (w.to(torch.bfloat16) * full).to(torch.bfloat16)

    pre = [deq(w, s) for w, s in zip(p.weights, p.scales, strict=True)]
    return {
        "torch_deq": [lambda w=w, s=s: p.x[:r] @ deq(w, s).t()
                      for w, s in zip(p.weights, p.scales, strict=True)],
        "torch_bf16": [lambda w=w: p.x[:r] @ w.t() for w in pre],
    }


def check_against_twin(p: Problem) -> str:
    """Kernel on copy 0 vs the CPU twin under the op's tolerance row; raises when wrong."""
    from qualification.tolerances import check
    from reference.twins.linear import linear_bf16_f32_ref, linear_fp8_ref

    p.out.fill_(float("nan"))
    p.kernel_call(0)()
    torch.cuda.synchronize()
    got = p.out.cpu()
    r = p.rows
    if torch.isnan(got[:r]).any():
        raise AssertionError(f"{p.shape.name}: live rows not fully written")
    if not torch.isnan(got[r:]).all():
        raise AssertionError(f"{p.shape.name}: padding rows were written")
    if p.shape.fp8:
        twin = linear_fp8_ref(p.x.cpu(), p.weights[0].cpu(), p.scales[0].cpu(), p.n_live.cpu())
        return str(check(got[:r], twin, "kernels.linear_fp8", "bf16"))
    twin = linear_bf16_f32_ref(p.x.cpu(), p.weights[0].cpu(), p.n_live.cpu())
    return str(check(got[:r], twin, "kernels.linear_bf16_f32", "fp32"))


def bench_one(shape: Shape, rows: int, args, config=None, with_torch: bool = True,
              variants: tuple[str, ...] = ()) -> dict:
    """variants: LinearLaunch field changes of the pinned FP8 launch (parse_variant), each timed
    beside it with the graphs replayed alternately; kernel_us stays the pinned launch's."""
    p = build_problem(shape, rows, args.copies, torch.device("cuda"), config)
    row = {"shape": shape.name, "n": shape.n, "k": shape.k, "rows": rows,
           "copies": len(p.weights), "config": None if config is None else asdict(config)}
    row["check"] = check_against_twin(p)
    reps = max(args.reps, len(p.weights))
    if variants and shape.fp8:
        from kernels.linear import linear_fp8_launch

        pinned = linear_fp8_launch(shape.n, shape.k)
        calls = {"pinned": p.kernel_calls(pinned)}
        for text in variants:
            calls[text] = p.kernel_calls(parse_variant(text, pinned)[1])
        times = time_graphs_alternating(calls, reps, args.trials, args.warmup)
        us = times.pop("pinned")
        for text, t in times.items():
            row[f"{text}_us"], row[f"{text}_over_pinned"] = t, t / us
    else:
        us = time_graph(p.kernel_calls(), reps, args.trials, args.warmup)
    moved = must_move_bytes(shape, rows)
    row.update(kernel_us=us, must_move_MB=moved / 1e6, achieved_TBps=moved / us / 1e6,
               frac_of_4_24=moved / us / 1e6 / (HBM_BYTES_PER_S / 1e12),
               cycled_MB=len(p.weights) * weight_bytes(shape) / 1e6)
    if shape.fp8:
        from kernels.linear import linear_fp8_launch, linear_fp8_splits

        s = linear_fp8_splits(shape.n, shape.k, config or linear_fp8_launch(shape.n, shape.k))
        row["splits"] = s
        row["partials_MB"] = 0 if s == 1 else 2 * 4 * s * rows * shape.n / 1e6
    if with_torch:
        for name, calls in torch_calls(p).items():
            t = time_graph(calls, max(len(calls), args.reps // 4), args.trials, args.warmup)
            row[f"{name}_us"] = t
            row[f"{name}_over_kernel"] = t / us
    del p
    torch.cuda.empty_cache()
    return row


def sweep_configs(shape: Shape):
    from kernels.linear import LinearLaunch, split_plan

    kb_total = math.ceil(shape.k / 128)
    seen = set()
    for bn in (32, 64, 128):
        for split in (1, 2, 3, 4, 6, 8, 12, 16, 24):
            s, _ = split_plan(kb_total, split)
            tiles = math.ceil(shape.n / bn)
            if s != split or not 64 <= tiles * s <= 1024 or (bn, s) in seen:
                continue
            seen.add((bn, s))
            for stages in (2, 3, 4):
                yield LinearLaunch(bn, s, num_stages=stages)


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':>8} {'rows':>4} {'µs':>7} {'MB':>7} {'TB/s':>6} {'%HBM':>5} {'S':>3} "
          f"{'deq×':>6} {'bf16×':>6}")
    for r in rows:
        print(f"{r['shape']:>8} {r['rows']:>4} {r['kernel_us']:>7.2f} {r['must_move_MB']:>7.2f} "
              f"{r['achieved_TBps']:>6.2f} {r['frac_of_4_24']:>5.0%} {r.get('splits', 1):>3} "
              f"{r.get('torch_deq_over_kernel', float('nan')):>6.1f} "
              f"{r.get('torch_bf16_over_kernel', float('nan')):>6.1f}")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6, 8])
    ap.add_argument("--shapes", nargs="+", default=[name for name, _ in SHAPES],
                    choices=[name for name, _ in SHAPES])
    ap.add_argument("--copies", type=int, default=None,
                    help="weight copies cycled (default: enough for 2 × L2)")
    ap.add_argument("--reps", type=int, default=64, help="calls per CUDA graph")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    ap.add_argument("--sweep", action="store_true",
                    help="time candidate LinearLaunch configs per shape (to pin them)")
    ap.add_argument("--variant", action="append", default=[], metavar="FIELD=V,…",
                    help="also time each FP8 shape's pinned LinearLaunch with these fields "
                         "changed (repeatable), replays alternating, e.g. hoist_scales=1")
    ap.add_argument("--out", type=Path, default=Path("bench_linear.json"))
    args = ap.parse_args(argv)
    from kernels.linear import linear_fp8_launch

    for text in args.variant:  # bad specs are refused before any GPU work
        parse_variant(text, linear_fp8_launch(1024, 3072))
    if not torch.cuda.is_available():
        raise SystemExit("bench_linear: needs a CUDA GPU")
    shapes = dict(SHAPES)
    results = []
    for name in args.shapes:
        for rows in args.rows:
            if not 1 <= rows <= 8:
                raise SystemExit(f"--rows: expected 1..8, got {rows}")
            row = bench_one(shapes[name], rows, args, with_torch=not args.no_torch,
                            variants=tuple(args.variant))
            results.append(row)
            print(f"{name} rows={rows}: {row['kernel_us']:.2f} µs, "
                  f"{row['achieved_TBps']:.2f} TB/s; check {row['check']}"
                  + "".join(f", {v} {row[f'{v}_us']:.2f} µs ({row[f'{v}_over_pinned']:.3f}×)"
                            for v in args.variant if f"{v}_us" in row))
            if args.sweep:
                for cfg in sweep_configs(shapes[name]):
                    t = bench_one(shapes[name], rows, args, cfg, with_torch=False)
                    t["sweep"] = True
                    results.append(t)
                    print(f"   {cfg}: {t['kernel_us']:.2f} µs ({t['frac_of_4_24']:.0%})")
    print_table([r for r in results if not r.get("sweep")])
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": results}, indent=2))
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
