"""Benchmark kernels.moe.moe_fp8 at per-rank TP8 shapes (H 3072, 256 experts × 192, top-8) on one
GPU, against the HBM floor and against the simplest torch formulation of the same op.

    python -m benchmarks.bench_moe --rows 1 4 6 8 --json bench_moe.json
    python -m benchmarks.bench_moe --rows 1 6 8 --ab silu_in_down   # a MoeLaunch flag A/B

Per row count: routing with a chosen number of distinct experts (defaults: independent top-8 of
256, 256·(1 − (31/32)^R) distinct: 8.0 / 30.5 / 44.4 / 57.4 at R = 1 / 4 / 6 / 8 rows), checked
against the twin (reference/twins/moe.py) before any timing — a wrong result raises. Timing: a CUDA
graph of `reps` calls, each on the next routing set; the sets use disjoint experts (and `copies`
weight copies), so the weights cycled through exceed L2 (60 MB) and are streamed from HBM like in
a decode round.
Median over `trials` graph replays after warm-up, timed with CUDA events. Bytes that must move:
distinct experts × (3·H·I E4M3 + scales) + x read + out written; bandwidth vs 4.24 TB/s
(measured copy bandwidth of the H200, read + write).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.launch_variant import parse_variant
from benchmarks.timing import capture_graph, time_graph, time_graphs_alternating  # noqa: F401

HBM_BYTES_PER_S = 4.24e12
L2_BYTES = 60e6
# MoeLaunch flags --ab may flip
AB_FLAGS = ("silu_in_down", "fold_silu", "fold_combine", "down_rows")
DEFAULT_DISTINCT = ((1, 8), (2, 16), (4, 30), (6, 44), (8, 57))  # (rows, distinct experts)


@dataclass(frozen=True)
class BenchSpec:
    rows: int
    distinct: int
    copies: int = 1  # weight copies cycled through (on top of disjoint expert sets)
    seed: int = 0
    hidden: int = 3072
    experts: int = 256
    top_k: int = 8
    inter: int = 192
    buffer_rows: int = 8  # padded row buffer (n_live = rows)


@dataclass(frozen=True)
class Problem:
    spec: BenchSpec
    x: torch.Tensor  # [R, H] bf16
    weights: list[torch.Tensor]  # per routing set [R, K] fp32
    ids: list[torch.Tensor]  # per routing set [R, K] int32
    fc: list[torch.Tensor]  # per copy [E, 2I, H] E4M3
    fc_s: list[torch.Tensor]
    proj: list[torch.Tensor]  # per copy [E, H, I] E4M3
    proj_s: list[torch.Tensor]
    n_live: torch.Tensor  # [1] int32

    @property
    def sets(self) -> int:
        return len(self.ids)


def routing_sets(spec: BenchSpec, gen: torch.Generator) -> list[torch.Tensor]:
    """Disjoint expert sets of `distinct` experts; each set spread over `rows` rows × top-k slots
    (distinct within a row, every expert of the set used)."""
    d, k, r = spec.distinct, spec.top_k, spec.rows
    if not k <= d <= min(r * k, spec.experts):
        hi = min(r * k, spec.experts)
        raise ValueError(f"distinct: expected {k}..{hi} for {r} rows, got {d}")
    perm = torch.randperm(spec.experts, generator=gen)
    out = []
    for j in range(max(1, spec.experts // d)):
        chosen = perm[j * d : (j + 1) * d]
        slots = torch.arange(r * k)
        ids = chosen[slots % d].view(r, k)  # row r: consecutive experts mod d → distinct
        cols = torch.stack([torch.randperm(k, generator=gen) for _ in range(r)])
        ids = torch.gather(ids, 1, cols)
        full = torch.zeros(spec.buffer_rows, k, dtype=torch.int32)
        full[:r] = ids.to(torch.int32)
        out.append(full)
    return out


def random_fp8(shape, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes (N(0,1)·16, clamped) with random positive block scales, made on gen's device."""
    *lead, n, c = shape
    dev = gen.device
    q = (torch.randn(*shape, generator=gen, device=dev) * 16).clamp(-448, 448)
    s = torch.rand(*lead, -(-n // 128), -(-c // 128), generator=gen, device=dev) * 1e-3 + 1e-4
    return q.to(torch.float8_e4m3fn), s


def build_problem(spec: BenchSpec, device: torch.device) -> Problem:
    gen = torch.Generator().manual_seed(spec.seed)
    h, e, i, r = spec.hidden, spec.experts, spec.inter, spec.buffer_rows
    x = torch.randn(r, h, generator=gen).to(torch.bfloat16)
    ids = routing_sets(spec, gen)
    weights = []
    for _ in ids:
        w = torch.rand(r, spec.top_k, generator=gen) + 0.05
        weights.append((w / w.sum(-1, keepdim=True)).to(device))
    fc, fc_s, proj, proj_s = [], [], [], []
    dgen = torch.Generator(device).manual_seed(spec.seed + 1)
    for _ in range(spec.copies):
        q, s = random_fp8((e, 2 * i, h), dgen)
        fc.append(q), fc_s.append(s)
        q, s = random_fp8((e, h, i), dgen)
        proj.append(q), proj_s.append(s)
    n = torch.tensor([spec.rows], dtype=torch.int32, device=device)
    return Problem(spec, x.to(device), weights, [t.to(device) for t in ids], fc, fc_s, proj,
                   proj_s, n)


def kernel_call(p: Problem, copy: int, rset: int = 0, out: torch.Tensor | None = None,
                config=None, scratch=None):
    """config: a kernels.moe.MoeLaunch (None: the pinned one); scratch: the folded SiLU's
    counters, made once and shared by the calls as the op table does (None: one per call)."""
    from kernels.moe import moe_fp8

    c = copy % p.spec.copies
    args = (p.x, p.weights[rset], p.ids[rset], p.fc[c], p.fc_s[c], p.proj[c], p.proj_s[c], p.n_live)
    return lambda: moe_fp8(*args, out=out, config=config, scratch=scratch)


def torch_call(p: Problem, copy: int, rset: int = 0):
    """The simplest torch formulation: gather every slot's expert, dequantize to bf16, bmm."""
    c = copy % p.spec.copies
    fc, fc_s, proj, proj_s = p.fc[c], p.fc_s[c], p.proj[c], p.proj_s[c]
    r, k = p.spec.rows, p.spec.top_k
    ids = p.ids[rset][:r].reshape(-1).long()  # [S]
    x = p.x[:r].repeat_interleave(k, dim=0)  # [S, H]
    wts = p.weights[rset][:r]

    def deq(w, s):  # [S, N, C] E4M3, [S, nb, cb] → bf16
        full = s.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
        return (w.to(torch.bfloat16) * full[:, : w.shape[1], : w.shape[2]]).to(torch.bfloat16)

    def run():
        w1 = deq(fc[ids], fc_s[ids])  # [S, 2I, H]
        gu = torch.bmm(w1, x[:, :, None])[..., 0]  # [S, 2I]
        g, u = gu.chunk(2, dim=-1)
        a = (torch.nn.functional.silu(g.float()) * u.float()).to(torch.bfloat16)
        y = torch.bmm(deq(proj[ids], proj_s[ids]), a[:, :, None])[..., 0]  # [S, H]
        return (y.view(r, k, -1).float() * wts[..., None]).sum(1).to(torch.bfloat16)

    return run


def check_against_twin(p: Problem, config=None) -> dict:
    """Kernel (config: a MoeLaunch, None: the pinned one) vs twin on routing set 0 (CPU twin);
    raises AssertionError when wrong."""
    from qualification.tolerances import check
    from reference.twins.moe import moe_fp8_ref

    r = p.spec.rows
    out = torch.full((p.spec.buffer_rows, p.spec.hidden), 12288.0, dtype=torch.bfloat16,
                     device=p.x.device)
    kernel_call(p, 0, 0, out, config)()
    torch.cuda.synchronize()
    got = out.cpu()
    if not torch.isfinite(got[:r]).all():
        raise AssertionError("moe_fp8: non-finite or unwritten live rows")
    if not (got[r:] == 12288.0).all():
        raise AssertionError("moe_fp8: padding rows were written")
    twin = moe_fp8_ref(p.x.cpu(), p.weights[0].cpu(), p.ids[0].cpu(), p.fc[0].cpu(),
                       p.fc_s[0].cpu(), p.proj[0].cpu(), p.proj_s[0].cpu(), p.n_live.cpu())
    margin = check(got[:r], twin, "kernels.moe.e2e", "bf16")
    base = torch_call(p, 0, 0)().cpu().double()
    tw = twin.double()
    metric = float(1 - 2 * (base * tw).sum() / ((base * base).sum() + (tw * tw).sum()))
    return {"kernel_vs_twin": str(margin), "torch_baseline_qual5_vs_twin": metric}


def must_move_bytes(spec: BenchSpec) -> int:
    h, i = spec.hidden, spec.inter
    nh = math.ceil(h / 128)
    scales = 4 * (math.ceil(2 * i / 128) * nh + nh * math.ceil(i / 128))
    per_expert = 3 * h * i + scales
    return spec.distinct * per_expert + 2 * 2 * spec.rows * h  # + x read, out written (bf16)


def flipped(pinned, **flags):
    """pinned with MoeLaunch flags set; a flag that moves a launch another pinned flag moves
    (fold_silu / silu_in_down: launch 3; fold_combine / down_rows: launch 5) switches that one
    off, so each variant is a valid launch."""
    rivals = {"fold_silu": "silu_in_down", "silu_in_down": "fold_silu",
              "fold_combine": "down_rows", "down_rows": "fold_combine"}
    for flag, on in list(flags.items()):
        if on and rivals[flag] not in flags:
            flags[rivals[flag]] = False
    return dataclasses.replace(pinned, **flags)


def bench_one(spec: BenchSpec, reps: int, trials: int, warmup: int, with_torch: bool,
              fold_ab: bool = False, ab: tuple[str, ...] = (),
              variants_text: tuple[str, ...] = ()) -> dict:
    """fold_ab: also time the other settings of MoeLaunch.fold_silu / fold_combine; ab: each
    named MoeLaunch flag flipped from its pinned value; variants_text: MoeLaunch field changes
    (parse_variant); the graphs replayed alternately; kernel_us stays the pinned launch's
    time."""
    dev = torch.device("cuda")
    p = build_problem(spec, dev)
    from kernels.moe import MoeScratch, moe_launch

    pinned = moe_launch(spec.hidden, spec.inter)
    row = {**asdict(spec), "routing_sets": p.sets, "launch": asdict(pinned)}
    row.update(check_against_twin(p))
    out = torch.empty(spec.buffer_rows, spec.hidden, dtype=torch.bfloat16, device=dev)
    scratch = MoeScratch.create(dev)
    variants = {"pinned": pinned}
    if fold_ab:
        for silu, combine in ((False, False), (True, False), (False, True), (True, True)):
            if (silu, combine) != (pinned.fold_silu, pinned.fold_combine):
                variants[f"fold_silu={int(silu)},fold_combine={int(combine)}"] = flipped(
                    pinned, fold_silu=silu, fold_combine=combine)
    for flag in ab:
        variants[f"{flag}={int(not getattr(pinned, flag))}"] = flipped(
            pinned, **{flag: not getattr(pinned, flag)})
    for text in variants_text:
        name, cfg = parse_variant(text, pinned)
        variants[name] = cfg
    calls = {name: [kernel_call(p, j, j % p.sets, out, cfg, scratch)
                    for j in range(max(p.sets, spec.copies))] for name, cfg in variants.items()}
    cycled = min(spec.experts, spec.distinct * p.sets) * spec.copies
    row["weights_cycled_MB"] = cycled * 3 * spec.hidden * spec.inter / 1e6
    if row["weights_cycled_MB"] * 1e6 < 2 * L2_BYTES:
        print(f"warning: only {row['weights_cycled_MB']:.0f} MB cycled; raise --copies")
    times = time_graphs_alternating(calls, reps, trials, warmup)
    us = times.pop("pinned")
    for name, t in times.items():
        row[f"{name}_us"] = t
        row[f"{name}_over_pinned"] = t / us
    moved = must_move_bytes(spec)
    row.update(kernel_us=us, must_move_MB=moved / 1e6, achieved_TBps=moved / us / 1e6,
               frac_of_4_24=moved / us / 1e6 / (HBM_BYTES_PER_S / 1e12))
    if with_torch:
        tcalls = [torch_call(p, j, j % p.sets) for j in range(len(calls["pinned"]))]
        tus = time_graph(tcalls, max(1, reps // 4), trials, warmup)
        row.update(torch_us=tus, torch_over_kernel=tus / us)
    del p
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 6, 8])
    ap.add_argument("--distinct", type=int, nargs="*", default=None,
                    help="distinct experts per row count (default: independent top-8 of 256)")
    ap.add_argument("--copies", type=int, default=1)
    ap.add_argument("--reps", type=int, default=32, help="calls per CUDA graph")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    ap.add_argument("--fold-ab", action="store_true",
                    help="also time the other MoeLaunch.fold_silu / fold_combine settings, "
                         "replays alternating")
    ap.add_argument("--ab", nargs="+", default=[], metavar="FLAG", choices=AB_FLAGS,
                    help="also time each MoeLaunch flag flipped, replays alternating "
                         f"({', '.join(AB_FLAGS)})")
    ap.add_argument("--variant", action="append", default=[], metavar="FIELD=V,…",
                    help="also time the pinned MoeLaunch with these fields changed (repeatable), "
                         "e.g. down_rows=1,silu_in_down=1,down_block_n=128")
    ap.add_argument("--json", type=Path, default=Path("bench_moe.json"))
    args = ap.parse_args(argv)
    from kernels.moe_launch import moe_launch

    for text in args.variant:  # bad specs are refused before any GPU work
        parse_variant(text, moe_launch(3072, 192))
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe: needs a CUDA GPU")
    table = dict(DEFAULT_DISTINCT)
    distinct = args.distinct or [table.get(r, min(256, 8 * r)) for r in args.rows]
    if len(distinct) != len(args.rows):
        raise SystemExit(f"--distinct: expected {len(args.rows)} values, got {len(distinct)}")
    rows = []
    for r, d in zip(args.rows, distinct, strict=True):
        spec = BenchSpec(rows=r, distinct=d, copies=args.copies, seed=args.seed)
        row = bench_one(spec, args.reps, args.trials, args.warmup, not args.no_torch,
                        args.fold_ab, tuple(args.ab), tuple(args.variant))
        rows.append(row)
        print(f"rows={r} distinct={d}: {row['kernel_us']:.1f} µs, {row['must_move_MB']:.1f} MB, "
              f"{row['achieved_TBps']:.2f} TB/s ({row['frac_of_4_24']:.0%} of 4.24)"
              + (f", torch {row['torch_us']:.1f} µs ({row['torch_over_kernel']:.1f}×)"
                 if "torch_us" in row else "")
              + "".join(f", {k[:-3]} {v:.1f} µs" for k, v in row.items()
                        if k.endswith("_us") and "=" in k)
              + f"\n   check: {row['kernel_vs_twin']}")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"{'rows':>4} {'distinct':>8} {'µs':>8} {'MB':>7} {'TB/s':>6} {'%HBM':>5} "
          f"{'torch×':>7}")
    for row in rows:
        print(f"{row['rows']:>4} {row['distinct']:>8} {row['kernel_us']:>8.1f} "
              f"{row['must_move_MB']:>7.1f} {row['achieved_TBps']:>6.2f} "
              f"{row['frac_of_4_24']:>5.0%} {row.get('torch_over_kernel', float('nan')):>7.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
