"""kernels/moe.py against its twins (reference/twins/moe.py), stage by stage, end to end, and
against the unquantized FP32 reference ops.moe (the qualification metric for FP8 GEMMs).

Inputs are snapped: x is E4M3 codes × a power-of-two group scale with ±448 in every group (its
act-quant is lossless), weights are E4M3 codes × power-of-two block scales whose neighbours differ
by 4× (a wrong scale block or a dropped expert moves outputs by O(1)), half of the weights zero.
Experts no live row routes to have NaN scales; padding rows hold NaN / 1e30 and route to those
poisoned experts, so anything read from them would show.

Dimension letters: R buffer rows, n live rows, H hidden, E experts, K top-k, I intermediate.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from iquestrt.capture import graph_capture
from kernels import moe as moe_module
from kernels.fp8 import E4M3
from kernels.moe import (
    COUNTERS,
    MAX_TILES,
    MoeLaunch,
    MoeScratch,
    moe_down_fp8,
    moe_fp8,
    moe_gate_up_fp8,
    moe_launch,
)
from qualification.tolerances import check, grid_steps, tolerance
from reference import ops
from reference.twins.moe import moe_down_fp8_ref, moe_fp8_ref, moe_gate_up_fp8_ref
from tests.kernels.sm90 import compile_sm90

CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
POS_E4M3 = CODES[(CODES > 0) & ~torch.isnan(CODES)].unique()  # positive finite E4M3 values
POISON = 12288.0  # exact in bf16; padding rows of outputs must keep it


@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    experts: int
    top_k: int
    inter: int
    rows: int  # buffer width R
    n_live: int
    x_dtype: torch.dtype = torch.bfloat16
    config: MoeLaunch | None = None
    strided: bool = False  # x, ids and weights as non-contiguous views


@dataclass(frozen=True)
class Inputs:
    x: torch.Tensor  # [R, H]
    weights: torch.Tensor  # [R, K] fp32
    ids: torch.Tensor  # [R, K]
    fc: torch.Tensor  # [E, 2I, H] E4M3
    fc_s: torch.Tensor
    proj: torch.Tensor  # [E, H, I] E4M3
    proj_s: torch.Tensor
    n: torch.Tensor  # [1] int32


def pick(pool: torch.Tensor, shape, gen) -> torch.Tensor:
    return pool[torch.randint(len(pool), shape, generator=gen)]


def signs(shape, gen) -> torch.Tensor:
    return torch.randint(2, shape, generator=gen).float() * 2 - 1


def snapped_weights(e: int, rows: int, cols: int, base_exp: int, gen):
    """E4M3 codes in [1/8, 16], half zero, × 2^(base + e mod 2 ± 1), the ±1 alternating over
    neighbouring scale blocks (so a shifted block is off by 4×)."""
    codes = pick(POS_E4M3[(POS_E4M3 >= 0.125) & (POS_E4M3 <= 16)], (e, rows, cols), gen)
    codes = codes * signs(codes.shape, gen) * (torch.rand(codes.shape, generator=gen) < 0.5)
    nb, kb = -(-rows // 128), -(-cols // 128)
    grid = (torch.arange(nb)[:, None] + torch.arange(kb)[None, :]) % 2 * 2 - 1  # [nb, kb]
    exps = base_exp + (torch.arange(e) % 2)[:, None, None] + grid[None]
    return codes.to(E4M3), torch.exp2(exps.float())


def make_inputs(case: Case, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    h, e, k, i, r, n = case.hidden, case.experts, case.top_k, case.inter, case.rows, case.n_live
    # x: codes in [1, 448] with ±448 in each 128-column group, × 2^p per group
    groups = -(-h // 128)
    x = pick(POS_E4M3[POS_E4M3 >= 1], (r, h), gen) * signs((r, h), gen)
    for g in range(groups):
        col = g * 128 + int(torch.randint(min(128, h - g * 128), (1,), generator=gen))
        x[:, col] = 448.0 * signs((r,), gen)
    p = torch.randint(-6, -4, (r, groups), generator=gen).float()
    x = x * torch.exp2(p).repeat_interleave(128, dim=1)[:, :h]
    # routing: experts [0, e - 2) serve live rows; the last two are routed only by padding rows
    live_pool = e - 2
    ids = torch.stack([torch.randperm(live_pool, generator=gen)[:k] for _ in range(r)])
    if n >= 3:  # one expert shared by three rows, at different k positions
        shared = int(ids[0, 0])
        for row, slot in ((1, k - 1), (2, k // 2)):
            j = int((ids[row] == shared).nonzero()[0]) if (ids[row] == shared).any() else slot
            ids[row, j], ids[row, slot] = ids[row, slot].clone(), shared
    ids[n:, 0] = e - 1
    ids[n:, 1:] = e - 2
    ids = ids.to(torch.int32 if seed % 2 else torch.int64)
    w = torch.rand(r, k, generator=gen) + 0.1
    w = w / w.sum(-1, keepdim=True)
    shift = -6 - round(math.log2(h / 128))  # keep gate/up pre-activations O(1) as H grows
    fc, fc_s = snapped_weights(e, 2 * i, h, shift, gen)
    proj, proj_s = snapped_weights(e, h, i, -6, gen)
    unrouted = sorted(set(range(e)) - set(ids[:n].flatten().tolist()))
    fc_s[unrouted] = float("nan")
    proj_s[unrouted] = float("nan")
    x[n:] = float("nan")
    x[n:, 0] = 1e30
    w[n:] = float("nan")
    return Inputs(x.to(case.x_dtype), w, ids, fc, fc_s, proj, proj_s,
                  torch.tensor([n], dtype=torch.int32))


def to_dev(inp: Inputs, device, strided: bool = False) -> Inputs:
    d = Inputs(*(t.to(device) for t in (inp.x, inp.weights, inp.ids, inp.fc, inp.fc_s,
                                        inp.proj, inp.proj_s, inp.n)))
    if not strided:
        return d
    r, h = d.x.shape
    wide = torch.zeros(r, h + 37, dtype=d.x.dtype, device=device)
    wide[:, 5 : 5 + h] = d.x
    x = wide[:, 5 : 5 + h]  # row stride h + 37
    ids = d.ids.t().contiguous().t()  # column-major [R, K]
    weights = d.weights.t().contiguous().t()
    assert not (x.is_contiguous() or ids.is_contiguous() or weights.is_contiguous())
    return Inputs(x, weights, ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)


def qual5_metric(x: torch.Tensor, y: torch.Tensor) -> float:
    """The FP8-GEMM bar: 1 − 2⟨x,y⟩ / (|x|² + |y|²) in fp64, per output row [n, H]; the
    worst row (a dropped slot in one row must not be averaged away by the others)."""
    x, y = x.double(), y.double()
    per_row = 1 - 2 * (x * y).sum(-1) / ((x * x).sum(-1) + (y * y).sum(-1))
    return float(per_row.max())


def unquantized(inp: Inputs, n: int) -> torch.Tensor:
    """ops.moe in FP32 on the dequantized weights (x's act-quant is lossless by construction);
    only the routed experts are dequantized (ids renumbered into that subset)."""
    used, ids = torch.unique(inp.ids[:n].long(), return_inverse=True)
    fc = ops.dequant_block(inp.fc[used], inp.fc_s[used])
    proj = ops.dequant_block(inp.proj[used], inp.proj_s[used])
    return ops.moe(inp.x[:n].float(), inp.weights[:n], ids, fc, proj)


def poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=dtype, device=device)


def assert_live_written_pad_untouched(out: torch.Tensor, live: int, what: str) -> None:
    out = out.cpu().float()
    assert torch.isfinite(out[:live]).all(), f"{what}: live rows not fully written (or NaN leaked)"
    assert (out[:live] != POISON).all(), f"{what}: live rows not fully written"
    assert (out[live:] == POISON).all(), f"{what}: padding rows were written"


def run_case(case: Case, seed: int, device) -> dict[str, object]:
    inp = make_inputs(case, seed)
    d = to_dev(inp, device, case.strided)
    n, k = case.n_live, case.top_k
    cfg = case.config
    report: dict[str, object] = {}

    # stage 1: SiLU(gate)·up, FP32 per slot
    a = moe_gate_up_fp8(d.x, d.ids, d.fc, d.fc_s, d.n, out=poisoned(
        (case.rows * k, case.inter), torch.float32, device), config=cfg)
    assert_live_written_pad_untouched(a, n * k, "gate_up out")
    a = a.cpu()
    a_twin = moe_gate_up_fp8_ref(inp.x, inp.ids, inp.fc, inp.fc_s, inp.n)
    report["gate_up"] = check(a[: n * k], a_twin, "kernels.moe.gate_up", "fp32")

    # stage 2 on the kernel's own intermediate, FP32 out: accumulation order only
    y = moe_down_fp8(a.to(device), d.weights, d.ids, d.proj, d.proj_s, d.n,
                     out=poisoned((case.rows, case.hidden), torch.float32, device),
                     out_dtype=torch.float32, config=cfg)
    assert_live_written_pad_untouched(y, n, "down out (fp32)")
    y_twin = moe_down_fp8_ref(a, inp.weights, inp.ids, inp.proj, inp.proj_s, inp.n,
                              out_dtype=torch.float32)
    report["down"] = check(y.cpu()[:n], y_twin, "kernels.moe.down", "fp32")

    # whole op, bf16 out
    o = moe_fp8(d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n,
                out=poisoned((case.rows, case.hidden), torch.bfloat16, device), config=cfg)
    assert_live_written_pad_untouched(o, n, "moe out (bf16)")
    o = o.cpu()[:n]
    # moe_fp8 recomputes stage 1 deterministically (no atomics), i.e. exactly `a`
    staged = moe_down_fp8_ref(a, inp.weights, inp.ids, inp.proj, inp.proj_s, inp.n)
    report["bf16"] = check(o, staged, "kernels.moe", "bf16")
    ulps = grid_steps(o, staged, "bf16")
    assert ulps.max() <= 1, f"bf16 output off by {int(ulps.max())} ulps from the twin"
    report["bf16_ulp_flips"] = f"{int((ulps > 0).sum())} of {ulps.numel()}"
    twin = moe_fp8_ref(inp.x, inp.weights, inp.ids, inp.fc, inp.fc_s, inp.proj, inp.proj_s, inp.n)
    report["e2e"] = check(o, twin, "kernels.moe.e2e", "bf16")
    metric = qual5_metric(o, unquantized(inp, n))
    bound = tolerance("kernels.moe.vs_unquantized", "qual5").max_rel
    assert metric < bound, f"qual5 metric {metric:.3e} vs unquantized ops.moe ≥ {bound}"
    report["qual5_vs_unquantized"] = f"{metric:.3e} (bound {bound})"
    return report


CASES = (
    Case("tiny-8of8", 128, 16, 4, 64, 8, 8),
    Case("tiny-5of8", 128, 16, 4, 64, 8, 5),
    Case("tiny-1of8", 128, 16, 4, 64, 8, 1, torch.float32),
    Case("tiny-3of3-strided", 128, 16, 4, 64, 3, 3, torch.float16, strided=True),
    # partial K block (200), partial channel tile and a scale block straddling gate/up (I = 96)
    # with one block per gate/up K split: 2 splits, the second partial
    Case("odd-5of6", 200, 8, 3, 96, 6, 5, config=MoeLaunch(64, 64, 128, gate_up_k_blocks=1)),
    # 5 hidden blocks in splits of 2: the last split has one block and one beyond H
    Case("split3-7of8", 640, 16, 4, 64, 8, 7, config=MoeLaunch(32, 64, 128, gate_up_k_blocks=2,
                                                              gate_up_warps=2, down_warps=2)),
    # the per-rank structure at small H: top-8, I = 192 (gate/up scale block 1 holds gate rows
    # 128–191 and up rows 0–63; down's second K block is partial), the default (CPU) launch
    Case("rank-like-6of8", 256, 24, 8, 192, 8, 6),
    # the H200's pinned launch (moe_launch(..., "cuda")) on the CPU: 32-channel tiles, K splits
    # of 6 blocks (7 blocks here: a full split and a short one), 64-channel down tiles
    Case("h200-launch-3of4", 896, 12, 4, 192, 4, 3, config=moe_launch(3072, 192, "cuda")),
)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.slow
def test_moe_matches_twin(case, device):
    t0 = time.perf_counter()
    report = run_case(case, seed=100 + CASES.index(case), device=device)
    print(f"\n[{case.name}] {time.perf_counter() - t0:.1f}s")
    for key, val in report.items():
        print(f"  {key}: {val}")


@pytest.mark.slow
def test_padded_width_is_bit_identical(device):
    """5 live rows in an 8-row buffer give exactly the bits of a 5-row buffer."""
    case = Case("tiny-5of8", 128, 16, 4, 64, 8, 5)
    inp = make_inputs(case, 7)
    d = to_dev(inp, device)
    padded = moe_fp8(d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)[:5]
    exact = moe_fp8(d.x[:5], d.weights[:5], d.ids[:5], d.fc, d.fc_s, d.proj, d.proj_s)
    assert torch.equal(padded.cpu().view(torch.int16), exact.cpu().view(torch.int16))


@pytest.mark.slow
def test_prequantized_operand_gives_the_same_bits(device):
    """moe_fp8(quantized=quantize_act(x)) == moe_fp8(x) bit for bit (the attention tail made
    the quantization); wrong scales change the result; a bad pair is named."""
    from kernels.fp8 import quantize_act

    case = Case("tiny-5of8", 128, 16, 4, 64, 8, 5)
    d = to_dev(make_inputs(case, 9), device)
    args = (d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)
    want = moe_fp8(*args)[:5].cpu().view(torch.int16)
    xq, xs = quantize_act(d.x, d.n)
    got = moe_fp8(*args, quantized=(xq, xs))[:5].cpu().view(torch.int16)
    assert torch.equal(got, want)
    off = moe_fp8(*args, quantized=(xq, xs * 2))[:5].cpu().view(torch.int16)
    assert not torch.equal(off, want)
    for bad, words in (((xq[:, :64], xs), r"quantized\[0\]"), ((xq, xs.double()),
                                                                r"quantized\[1\]")):
        with pytest.raises(ValueError, match=words):
            moe_fp8(*args, quantized=bad)


# tiny-5of8, odd-5of6, h200-launch-3of4; the folds are off (kernels/moe_launch.py), so the
# h200 launch's case (a minute under the interpreter) runs on a GPU only
FOLD_CASES = (CASES[1], CASES[4], pytest.param(CASES[7], marks=pytest.mark.gpu))


@pytest.mark.parametrize("case", FOLD_CASES, ids=lambda c: c.name)
@pytest.mark.slow
def test_folded_silu_gives_the_unfolded_bits(case, device):
    """SiLU + requant inside the gate/up launch (last arrival per expert) and the k-ordered
    combine inside the down launch (K-th arrival per row and tile) == their own launches, bit
    for bit, for the whole op and each stage's output; the counters are all 0 afterwards, so
    one scratch serves the next call (a second call gives the same bits)."""
    d = to_dev(make_inputs(case, 31), device)
    cfg = separate(case.config or moe_launch(case.hidden, case.inter, torch.device(device).type))
    on, off = (dataclasses.replace(cfg, fold_silu=f, fold_combine=f) for f in (True, False))
    scratch = MoeScratch.create(device)
    n, k = case.n_live, case.top_k
    args = (d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)
    want = moe_fp8(*args, config=off)[:n].cpu().view(torch.int16)
    for _ in range(2):
        got = moe_fp8(*args, config=on, scratch=scratch)[:n].cpu().view(torch.int16)
        assert torch.equal(got, want)
        assert int(scratch.counters.abs().sum()) == 0, "a counter was not put back to 0"
    a_on = moe_gate_up_fp8(d.x, d.ids, d.fc, d.fc_s, d.n, config=on, scratch=scratch)
    a_off = moe_gate_up_fp8(d.x, d.ids, d.fc, d.fc_s, d.n, config=off)
    assert torch.equal(a_on[: n * k].cpu(), a_off[: n * k].cpu())
    down = (a_off, d.weights, d.ids, d.proj, d.proj_s, d.n)
    y_on = moe_down_fp8(*down, out_dtype=torch.float32, config=on, scratch=scratch)
    y_off = moe_down_fp8(*down, out_dtype=torch.float32, config=off)
    assert torch.equal(y_on[:n].cpu(), y_off[:n].cpu())
    assert int(scratch.counters.abs().sum()) == 0


# odd-5of6, rank-like-6of8; the H200 launch: test_moe_tp8_moved_launches_give_the_separate_bits
SILU_IN_DOWN_CASES = (CASES[4], CASES[6])
# (silu_in_down, fold_combine, down_rows): the launches that move, alone and together
MOVED = ((True, False, False), (True, True, False), (False, False, True), (True, False, True))


SM90_SMEM = 232_448  # bytes of shared memory one block may use on sm_90 (H100, H200)
# silu_in_down with down_rows needs 2 stages to fit SM90_SMEM at the TP8 shape (the sm_90
# compile test measures it)
SILU_ROWS_STAGES = 2


def separate(cfg: MoeLaunch) -> MoeLaunch:
    """cfg with launches 3, 4 and 5 one after another (no fold, none moved): the bits every
    moved or folded variant must give."""
    return dataclasses.replace(cfg, fold_silu=False, fold_combine=False, silu_in_down=False,
                               down_rows=False)


class NoLaunch:
    """A kernel that must not be launched: indexing it with a grid fails the test."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        raise AssertionError(f"{self.name} ran")


@pytest.mark.parametrize("case", SILU_IN_DOWN_CASES, ids=lambda c: c.name)
def test_moved_launches_give_the_separate_launches_bits(case, device, monkeypatch):
    """SiLU·up and its quantization recomputed by every down program from the gate/up partials
    (MoeLaunch.silu_in_down), and down + combine as one row-major launch (down_rows), alone,
    together and with the folded combine == launches 3, 4, 5 one after another, bit for bit:
    K splits of 1 and of 6 blocks, I = 96 and 192 (a group straddling gate/up, a partial second
    K block of down), 5 or 6 of 6–8 rows. The launches a variant replaces do not run (they
    raise here)."""
    d = to_dev(make_inputs(case, 41), device)
    cfg = separate(case.config or moe_launch(case.hidden, case.inter, torch.device(device).type))
    n = case.n_live
    args = (d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)
    out = moe_fp8(*args, config=cfg)[:n].cpu()
    check(out, moe_fp8_ref(*(t.cpu() for t in args))[:n], "kernels.moe.e2e", "bf16")
    want = out.view(torch.int16)
    for silu, combine, rows in MOVED:
        with monkeypatch.context() as mp:
            if silu:
                mp.setattr(moe_module, "_moe_silu_kernel", NoLaunch("launch 3 (SiLU)"))
            if rows:
                mp.setattr(moe_module, "_moe_down_kernel", NoLaunch("launch 4 (down)"))
                mp.setattr(moe_module, "_moe_combine_kernel", NoLaunch("launch 5 (combine)"))
            on = dataclasses.replace(cfg, silu_in_down=silu, fold_combine=combine,
                                     down_rows=rows)
            got = moe_fp8(*args, config=on)[:n].cpu().view(torch.int16)
        assert torch.equal(got, want), f"silu_in_down={silu} fold_combine={combine} rows={rows}"


def test_down_rows_stage_two_and_fp32_out(device):
    """The stage-2 API (moe_down_fp8 on a given FP32 intermediate) with down_rows: the same bits
    as launches 4 + 5, bf16 and fp32 out."""
    case = CASES[6]
    d = to_dev(make_inputs(case, 43), device)
    cfg = separate(moe_launch(case.hidden, case.inter, torch.device(device).type))
    n, k = case.n_live, case.top_k
    a = moe_gate_up_fp8(d.x, d.ids, d.fc, d.fc_s, d.n, config=cfg)
    down = (a, d.weights, d.ids, d.proj, d.proj_s, d.n)
    for dt in (torch.bfloat16, torch.float32):
        want = moe_down_fp8(*down, out_dtype=dt, config=cfg)[:n].cpu()
        got = moe_down_fp8(*down, out_dtype=dt, config=dataclasses.replace(cfg, down_rows=True))
        assert torch.equal(got[:n].cpu(), want), dt
    assert a.shape[0] == case.rows * k


def test_moved_launches_differ_when_their_inputs_do(device):
    """The moved launches read what they must: a routed expert's gate/up scales or a row's
    second routing weight doubled → other bits (the comparison above is not vacuous); and flags
    that move the same launch twice are refused."""
    case = CASES[6]
    d = to_dev(make_inputs(case, 42), device)
    cfg = dataclasses.replace(moe_launch(case.hidden, case.inter, torch.device(device).type),
                              silu_in_down=True)
    n = case.n_live
    args = [d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n]
    fc_s = d.fc_s.clone()
    fc_s[int(d.ids[0, 0])] *= 2
    w = d.weights.clone()
    w[0, 1] *= 2  # the row-major sum's second term
    for rows in (False, True):
        c = dataclasses.replace(cfg, down_rows=rows)
        want = moe_fp8(*args, config=c)[:n].cpu().view(torch.int16)
        for i, bad in ((4, fc_s), (1, w)):
            planted = list(args)
            planted[i] = bad
            got = moe_fp8(*planted, config=c)[:n].cpu().view(torch.int16)
            assert not torch.equal(got, want), (rows, i)
    with pytest.raises(ValueError, match="fold_silu and silu_in_down"):
        MoeLaunch(32, 64, 128, fold_silu=True, silu_in_down=True)
    with pytest.raises(ValueError, match="fold_combine and down_rows"):
        MoeLaunch(32, 64, 128, fold_combine=True, down_rows=True)


HOISTS = ({"down_hoist": True}, {"gate_up_hoist": True},
          {"down_hoist": True, "gate_up_hoist": True}, {"early_loads": True},
          {"early_loads": True, "down_hoist": True, "gate_up_hoist": True},
          {"early_loads": True, "down_rows": False},  # the slot-major down, loaded early
          # the row-major down pipelined over its experts (3 stages): ids ahead, or all hoisted
          {"down_ids_ahead": True, "down_stages": 3}, {"down_hoist": True, "down_stages": 3},
          # its scales and router weight one expert ahead
          {"down_scales_ahead": True, "down_stages": 3},
          # launch 3 asks L2 for the down weights of each row's first 2 experts (a hint)
          {"silu_prefetch": 2},
          # gate/up's compact grid with its scales hoisted
          {"gate_up_compact": True, "gate_up_hoist": True})
# on the CPU (interpreter time): every moved load at least once, each kernel variant it touches
# (gate/up and row-major down hoisted; routing early in gate/up, hoisted and slot-major down;
# the row-major down's ids ahead, its scales ahead)
CPU_HOISTS = HOISTS[2], HOISTS[4], HOISTS[5], HOISTS[6], HOISTS[8]


def hoist_label(h: dict) -> str:
    return "+".join(sorted(h))


@pytest.mark.parametrize("case", (CASES[2], CASES[4], CASES[6]),
                         ids=lambda c: c.name)
def test_hoisted_loads_give_the_same_bits(case, device):
    """Expert ids, router weights and scales loaded before the expert and K loops
    (MoeLaunch.down_hoist, gate_up_hoist), and the routing loaded for every buffer row before
    n_live is known (early_loads), == loaded where the pinned launch loads them, bit for bit:
    1 of 8 rows, a partial K block, I = 64, 96 and 192 (a partial second block of down);
    padding rows route to experts with NaN scales (`make_inputs`), so a padding row taken for
    a live one shows. The pinned H200 launch: test_moe_tp8_hoisted_loads_give_the_same_bits
    (a GPU)."""
    d = to_dev(make_inputs(case, 47), device)
    cfg = case.config or moe_launch(case.hidden, case.inter, torch.device(device).type)
    cfg = dataclasses.replace(cfg, down_rows=True, silu_in_down=False, fold_combine=False)
    args = (d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)
    n = case.n_live
    want = moe_fp8(*args, config=cfg)[:n].cpu().view(torch.int16)
    far = d.ids.clone()
    far[n:] = 1 << 24  # padding rows' ids past the experts: loaded early, never an address
    for h in CPU_HOISTS:
        on = dataclasses.replace(cfg, **h)
        for ids in (d.ids, far) if h.get("early_loads") else (d.ids,):
            got = moe_fp8(*args[:2], ids, *args[3:], config=on)[:n].cpu().view(torch.int16)
            assert torch.equal(got, want), hoist_label(h)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty gives NaN-filled floating tensors: a gate/up partial no program writes shows
    (the allocator could otherwise hand back an earlier call's right values)."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("case", (CASES[4], CASES[5], CASES[6], CASES[1]),
                         ids=lambda c: c.name)
def test_compact_gate_up_gives_the_slot_grids_bits(case, device, poisoned_empty, monkeypatch):
    """MoeLaunch.gate_up_compact: program w taking work item w (distinct expert, tile, split)
    == the slot grid, bit for bit, on every live slot — partial channel tiles and K blocks
    (odd-5of6), 3 K splits (split3-7of8), experts shared by rows (rank-like-6of8), padding
    rows routed to experts no live row uses (tiny-5of8). Planted: the grid cut to its first
    program leaves slots unwritten (NaN), so the comparison sees a missing item. A GPU:
    test_moe_tp8_compact_gate_up_gives_the_same_bits."""
    d = to_dev(make_inputs(case, 51), device)
    cfg = dataclasses.replace(case.config or moe_launch(case.hidden, case.inter,
                                                        torch.device(device).type),
                              fold_silu=False, early_loads=False)
    args = (d.x, d.ids, d.fc, d.fc_s, d.n)
    n, k = case.n_live, case.top_k
    want = moe_gate_up_fp8(*args, config=cfg)[: n * k].cpu()
    assert not want.isnan().any()
    on = dataclasses.replace(cfg, gate_up_compact=True)
    for c in (on, dataclasses.replace(on, gate_up_hoist=True)):  # with its scales hoisted too
        got = moe_gate_up_fp8(*args, config=c)[: n * k].cpu()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), c.gate_up_hoist
    monkeypatch.setattr(moe_module, "_gate_up_grid", lambda *a: (1,))
    assert moe_gate_up_fp8(*args, config=on)[: n * k].isnan().any()


def test_compact_gate_up_refusals():
    for other in ("fold_silu", "early_loads"):
        with pytest.raises(ValueError, match="set fold_silu and early_loads off"):
            MoeLaunch(32, 64, 128, gate_up_compact=True, **{other: True})


def test_hoisted_loads_read_what_they_must(device):
    """Each hoisted value reaches the result: a routed expert's gate/up or down scale block, an
    activation scale, a router weight or a routed expert id changed → other bits (so the
    comparison above is not vacuous); a hoist flag without the launch it changes is refused."""
    case = CASES[6]
    d = to_dev(make_inputs(case, 48), device)
    cfg = dataclasses.replace(moe_launch(case.hidden, case.inter, torch.device(device).type),
                              down_rows=True, down_hoist=True, gate_up_hoist=True)
    n, k = case.n_live, case.top_k
    args = [d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n]
    want = moe_fp8(*args, config=cfg)[:n].cpu().view(torch.int16)
    e_last = int(d.ids[n - 1, k - 1])
    fc_s, proj_s, w, ids = d.fc_s.clone(), d.proj_s.clone(), d.weights.clone(), d.ids.clone()
    fc_s[e_last, -1, -1] *= 2  # the up half's last block of the last slot's expert
    proj_s[e_last, -1, -1] *= 2  # down's last block (the partial one when I = 192)
    w[n - 1, k - 1] *= 2  # the last term of the row-major sum
    ids[n - 1, k - 1] = int(torch.arange(case.experts)[~torch.isin(
        torch.arange(case.experts), d.ids[:n].cpu())][0])  # an expert no row routed to
    x = d.x.clone()
    x[n - 1, -1] = x[n - 1, -1] * 1024 + 1  # the last row's last activation scale block
    for i, bad in ((4, fc_s), (6, proj_s), (1, w), (2, ids), (0, x)):
        planted = list(args)
        planted[i] = bad
        got = moe_fp8(*planted, config=cfg)[:n].cpu().view(torch.int16)
        assert not torch.equal(got, want), i
    ahead = dataclasses.replace(cfg, down_hoist=False, down_ids_ahead=True)
    assert not torch.equal(moe_fp8(*args[:2], ids, *args[3:], config=ahead)[:n].cpu()
                           .view(torch.int16), want), "ids ahead: the last id unread"
    with pytest.raises(ValueError, match="trace: stamps the row-major down"):
        moe_fp8(*args, config=dataclasses.replace(cfg, down_hoist=False, down_rows=False),
                trace=torch.zeros(1, dtype=torch.int64))
    for traced in (cfg, dataclasses.replace(cfg, down_hoist=False)):  # hoisted or not
        with pytest.raises(ValueError, match="trace: kernel timestamps need the launch's CUDA"):
            moe_fp8(*args, config=traced, trace=torch.zeros(8 * 4, 12, dtype=torch.int64))
    with pytest.raises(ValueError, match="down_hoist: .* needs down_rows on"):
        MoeLaunch(32, 64, 128, down_hoist=True)
    with pytest.raises(ValueError, match="down_hoist: .* silu_in_down off"):
        MoeLaunch(32, 64, 128, down_rows=True, silu_in_down=True, down_hoist=True)
    for bad in (dict(), dict(down_rows=True, down_hoist=True),
                dict(down_rows=True, silu_in_down=True)):
        with pytest.raises(ValueError, match="down_scales_ahead: .* needs down_rows on, "
                                             "silu_in_down and down_hoist off"):
            MoeLaunch(32, 64, 128, down_scales_ahead=True, **bad)
    wide = to_dev(make_inputs(Case("I384", 128, 4, 2, 384, 2, 2), 5), device)  # 3 K blocks
    ahead = MoeLaunch(32, 64, 128, down_rows=True, down_scales_ahead=True)
    with pytest.raises(ValueError, match="down_scales_ahead: .* <= 256; proj has I = 384"):
        moe_fp8(wide.x, wide.weights, wide.ids, wide.fc, wide.fc_s, wide.proj, wide.proj_s,
                wide.n, config=ahead)
    for bad in (-1, 65, 1.0):
        with pytest.raises(ValueError, match="silu_prefetch: expected an int in 0..64"):
            MoeLaunch(32, 64, 128, silu_prefetch=bad)
    for bad in (dict(fold_silu=True), dict(silu_in_down=True)):
        with pytest.raises(ValueError, match="silu_prefetch: .* set fold_silu and silu_in_down"):
            MoeLaunch(32, 64, 128, silu_prefetch=1, **bad)
    pf = dataclasses.replace(cfg, silu_prefetch=1)
    if torch.device(device).type == "cpu":  # the hint is PTX: the interpreter cannot run it
        with pytest.raises(ValueError, match="silu_prefetch: .* compiled kernels on CUDA only"):
            moe_fp8(*args, config=pf)
    strided = args[5].transpose(1, 2).contiguous().transpose(1, 2)  # proj[e] not one range
    with pytest.raises(ValueError, match="silu_prefetch: .* one contiguous range"):
        moe_fp8(*args[:5], strided, *args[6:], config=pf)


@pytest.mark.slow
def test_folded_silu_needs_clean_counters(device):
    """The invariant matters: counters left one arrival ahead make each expert's SiLU and each
    row's combine run before their last inputs are written (or never), which the unfolded bits
    show. The dirty call comes
    first on these inputs, so no freed buffer can hold their right intermediate. A scratch of
    the wrong shape is refused before any launch."""
    case = CASES[1]
    d = to_dev(make_inputs(case, 32), device)
    cfg = dataclasses.replace(separate(case.config or moe_launch(case.hidden, case.inter,
                                                                  torch.device(device).type)),
                              fold_silu=True, fold_combine=True)
    scratch = MoeScratch.create(device)
    scratch.counters.fill_(1)
    args = (d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)
    n = case.n_live
    dirty = moe_fp8(*args, config=cfg, scratch=scratch)[:n].cpu().view(torch.int16)
    want = moe_fp8(*args, config=dataclasses.replace(cfg, fold_silu=False, fold_combine=False))
    assert not torch.equal(dirty, want[:n].cpu().view(torch.int16))
    with pytest.raises(ValueError, match="scratch.counters"):
        moe_fp8(*args, scratch=MoeScratch(torch.zeros(COUNTERS - 1, dtype=torch.int32,
                                                       device=device)))
    # more hidden tiles than the combine counters cover: refused before any launch
    h = 16 * MAX_TILES + 16
    proj = torch.zeros(1, h, 64, dtype=E4M3, device=device)
    proj_s = torch.ones(1, -(-h // 128), 1, device=device)
    one = (torch.ones(1, 64, device=device), torch.ones(1, 1, device=device),
           torch.zeros(1, 1, dtype=torch.int32, device=device), proj, proj_s)
    with pytest.raises(ValueError, match="folded combine counts at most"):
        moe_down_fp8(*one, config=dataclasses.replace(cfg, down_block_n=16))


def weight_reads(monkeypatch, run) -> np.ndarray:
    """Addresses of every element the interpreter loads (unmasked lanes) while run() executes."""
    from triton.runtime import interpreter

    seen = []
    original = interpreter.InterpreterBuilder.create_masked_load

    def spy(self, ptrs, mask, *rest):
        seen.append(np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].copy())
        return original(self, ptrs, mask, *rest)

    with monkeypatch.context() as m:
        m.setattr(interpreter.InterpreterBuilder, "create_masked_load", spy)
        run()
    return np.concatenate([a.reshape(-1) for a in seen]).astype(np.uint64)


def expert_reads(addrs: np.ndarray, w: torch.Tensor) -> np.ndarray:
    """Per expert: how many of the loads fell on each element of w [E, N, C] (1-byte E4M3)."""
    lo = w.data_ptr()
    inside = addrs[(addrs >= lo) & (addrs < lo + w.numel())] - lo
    return np.bincount(inside.astype(np.int64), minlength=w.numel()).reshape(w.shape[0], -1)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts interpreter loads")
@pytest.mark.slow
def test_each_routed_expert_read_once(monkeypatch, device):
    """Dedup: every element of every routed expert (fc and proj) is loaded exactly once per call
    however many rows share the expert; unrouted experts are never loaded."""
    case = Case("tiny-6of8", 128, 16, 4, 64, 8, 6)
    inp = make_inputs(case, 41)
    d = to_dev(inp, device)
    routed = sorted(set(inp.ids[:6].flatten().tolist()))
    assert len(routed) < 6 * 4, "no expert shared between rows: the dedup check is vacuous"
    addrs = weight_reads(monkeypatch, lambda: moe_fp8(d.x, d.weights, d.ids, d.fc, d.fc_s,
                                                       d.proj, d.proj_s, d.n))
    for name, w in (("fc", d.fc), ("proj", d.proj)):
        counts = expert_reads(addrs, w)
        want = np.zeros_like(counts)
        want[routed] = 1
        assert np.array_equal(counts, want), f"{name}: expert elements not read exactly once"
    # broken variant: rows processed one by one (no dedup) re-read shared experts
    def per_row():
        for r in range(6):
            moe_gate_up_fp8(d.x[r : r + 1], d.ids[r : r + 1], d.fc, d.fc_s)
    counts = expert_reads(weight_reads(monkeypatch, per_row), d.fc)
    assert counts.max() > 1, "per-row control read every expert once: control is vacuous"


def pow2_requant(a: torch.Tensor) -> torch.Tensor:
    """The intermediate as a kernel with power-of-two act scales would see it."""
    r, c = a.shape
    amax = torch.zeros(r, -(-c // 128) * 128)
    amax[:, :c] = a.abs()
    amax = amax.reshape(r, -1, 128).amax(-1)
    scale = torch.exp2(torch.ceil(torch.log2(torch.where(amax > 0, amax / 448, 1.0))))
    full = scale.repeat_interleave(128, dim=1)[:, :c]
    return (a / full).clamp(-448, 448).to(E4M3).float() * full


def routed_neighbour(ids: torch.Tensor, nth: int) -> int:
    """The nth routed expert e whose neighbour e + 1 is routed too (finite, 2× different scales:
    with one scale block per tiny expert, "the next block" is the next expert's)."""
    routed = set(ids.flatten().tolist())
    return [e for e in sorted(routed) if e + 1 in routed][nth]


def fails(fn) -> str:
    with pytest.raises(AssertionError) as err:
        fn()
    return str(err.value).split(";")[0]


@pytest.mark.slow
def test_broken_variants_exceed_their_rows(device):
    """Each tolerance row of kernels/moe is shown to fail for its named broken variant."""
    case = Case("tiny-6of8", 128, 16, 4, 64, 8, 6)
    inp = make_inputs(case, 31)
    d = to_dev(inp, device)
    n, i = case.n_live, case.inter
    a_twin = moe_gate_up_fp8_ref(inp.x, inp.ids, inp.fc, inp.fc_s, inp.n)
    a = moe_gate_up_fp8(d.x, d.ids, d.fc, d.fc_s, d.n).cpu()[: n * 4]
    check(a, a_twin, "kernels.moe.gate_up", "fp32")
    out = {}

    def stage1(fc, fc_s):
        got = moe_gate_up_fp8(d.x, d.ids, fc.to(device), fc_s.to(device), d.n).cpu()[: n * 4]
        check(got, a_twin, "kernels.moe.gate_up", "fp32")

    swapped = torch.cat([inp.fc[:, i:], inp.fc[:, :i]], dim=1)  # one scale block: scales agree
    out["gate/up swapped"] = fails(lambda: stage1(swapped, inp.fc_s))
    e0 = routed_neighbour(inp.ids[:n], 0)
    shifted = inp.fc_s.clone()
    shifted[e0] = inp.fc_s[e0 + 1]  # expert e0 reads its neighbour's scale block (2× apart)
    out["fc scale block shifted"] = fails(lambda: stage1(inp.fc, shifted))
    out["bf16 intermediate (stage 1)"] = fails(
        lambda: check(a.bfloat16().float(), a_twin, "kernels.moe.gate_up", "fp32"))

    y_twin = moe_down_fp8_ref(a, inp.weights, inp.ids, inp.proj, inp.proj_s, inp.n,
                              out_dtype=torch.float32)
    full_twin = moe_fp8_ref(inp.x, inp.weights, inp.ids, inp.fc, inp.fc_s, inp.proj, inp.proj_s,
                            inp.n)

    def stage2(a_in, weights=d.weights, proj_s=d.proj_s, dtype=torch.float32):
        a_full = torch.zeros(case.rows * 4, i)
        a_full[: n * 4] = a_in
        return moe_down_fp8(a_full.to(device), weights, d.ids, d.proj, proj_s, d.n,
                            out_dtype=dtype).cpu()[:n]

    y = stage2(a)
    check(y, y_twin, "kernels.moe.down", "fp32")
    down = lambda got: check(got, y_twin, "kernels.moe.down", "fp32")  # noqa: E731
    out["bf16 intermediate (stage 2)"] = fails(lambda: down(stage2(a.bfloat16().float())))
    out["power-of-two requant scales"] = fails(lambda: down(stage2(pow2_requant(a))))
    dropped = d.weights.clone()
    dropped[:, -1] = 0.0  # the last top-k slot of every row dropped (an off-by-one k loop)
    y_drop = stage2(a, weights=dropped)
    out["dropped top-k slot (down)"] = fails(lambda: down(y_drop))
    out["dropped top-k slot (e2e)"] = fails(
        lambda: check(y_drop.bfloat16(), full_twin, "kernels.moe.e2e", "bf16"))
    bound = tolerance("kernels.moe.vs_unquantized", "qual5").max_rel
    drop_metric = qual5_metric(y_drop.bfloat16(), unquantized(inp, n))
    assert drop_metric > bound, f"dropped slot: qual5 metric {drop_metric:.2e} within {bound}"
    out["dropped top-k slot (qual5 metric)"] = f"{drop_metric:.2e} > {bound}"
    p_shift = d.proj_s.clone()
    e1 = routed_neighbour(inp.ids[:n], 1)
    p_shift[e1] = d.proj_s[e1 + 1]
    out["proj scale block shifted"] = fails(lambda: down(stage2(a, proj_s=p_shift)))
    staged_bf16 = moe_down_fp8_ref(a, inp.weights, inp.ids, inp.proj, inp.proj_s, inp.n)
    truncated = (y.view(torch.int32) & -65536).view(torch.float32).bfloat16()  # exact: low bits 0
    out["bf16 output by truncation"] = fails(
        lambda: check(truncated, staged_bf16, "kernels.moe", "bf16"))
    for key, val in out.items():
        print(f"\n  broken: {key}: {val}")


def test_wrapper_errors(device):
    case = Case("tiny-2of2", 128, 16, 4, 64, 2, 2)
    inp = make_inputs(case, 3)
    d = to_dev(inp, device)
    args = (d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s)
    with pytest.raises(ValueError, match="row buffer: expected 1..16 rows"):
        moe_fp8(d.x.repeat(9, 1), *args[1:])
    with pytest.raises(ValueError, match=r"weights: expected shape \(2, 4\)"):
        moe_fp8(d.x, d.weights[:, :3], *args[2:])
    with pytest.raises(ValueError, match="ids: expected dtype"):
        moe_fp8(d.x, d.weights, d.ids.float(), *args[3:])
    with pytest.raises(ValueError, match=r"fc_scale_inv: expected shape \(16, 1, 1\)"):
        moe_fp8(*args[:4], d.fc_s[:, :, :0], *args[5:])
    with pytest.raises(ValueError, match="fc: expected dtype"):
        moe_fp8(*args[:3], d.fc.float(), *args[4:])
    with pytest.raises(ValueError, match="proj: expected dim 1 = hidden 128"):
        moe_fp8(*args[:5], d.proj[:, :64], d.proj_s)
    with pytest.raises(ValueError, match="n_live: expected dtype"):
        moe_fp8(*args, torch.tensor([1], device=device))
    with pytest.raises(ValueError, match="out_dtype"):
        moe_fp8(*args, out_dtype=torch.float16)


SM90_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import moe
from tests.kernels.sass import disassemble, loop_own_load_waits, round_trips_before_tiles
from tests.kernels.sm90 import loop_facts

def build(fn, sig, const, opts, div16):
    full = {n: "constexpr" if n in const else sig.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    k = triton.compile(ASTSource(fn, full, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = k.asm["ptx"]
    got = {t: len(re.findall(t, ptx))
           for t in ("cp.async", "wgmma", "mma.sync", "ex2", "atom.global.gpu.acq_rel",
                     "ld.volatile.global", "%globaltimer", "prefetch.global.L2::evict_last")}
    got["prefetch_after_wait"] = int(0 <= ptx.find("griddepcontrol.wait")
                                     < ptx.find("prefetch.global.L2::evict_last"))
    # synchronous loads inside a loop body and the cp.async groups its wait leaves in flight
    got["loop_loads"], got["in_flight"] = loop_facts(k.asm["ttgir"])
    got["smem"] = k.metadata.shared  # bytes of shared memory per program
    if got["cp.async"]:  # global-load round trips before the first tile load (SASS), and
        # the waits a pass of the main loop makes for global loads it issued itself
        code = disassemble(k.asm["cubin"])
        got["trips"], got["own_waits"] = round_trips_before_tiles(code), loop_own_load_waits(code)
    return got

tp8 = dict(H=3072, I=192, K=8, K_PAD=8, S_PAD=64, BLOCK_R=16, PDL=False)
cfg = moe.moe_launch(3072, 192)
f8, f32, i32 = "*fp8e4nv", "*fp32", "*i32"
out = {
    "silu": build(moe._moe_silu_kernel,
        dict(p_ptr=f32, n_live_ptr=i32, a_ptr=f32, aq_ptr=f8, as_ptr=f32, ids_ptr="*i64",
             proj_ptr=f8),
        dict(I=192, K=8, KS=cfg.k_splits(3072), GROUPS=2, QUANT=True, PDL=False, PREFETCH=0,
             LINES=1),
        dict(num_warps=cfg.num_warps), ["p_ptr", "aq_ptr", "as_ptr", "stride_pj", "stride_ps"]),
    "silu_prefetch": build(moe._moe_silu_kernel,
        dict(p_ptr=f32, n_live_ptr=i32, a_ptr=f32, aq_ptr=f8, as_ptr=f32, ids_ptr="*i64",
             proj_ptr=f8),
        dict(I=192, K=8, KS=cfg.k_splits(3072), GROUPS=2, QUANT=True, PDL=True, PREFETCH=2,
             LINES=3072 * 192 // 128),
        dict(num_warps=cfg.num_warps), ["p_ptr", "aq_ptr", "as_ptr", "proj_ptr", "stride_pj",
                                        "stride_ps", "stride_pe"]),
    "down": build(moe._moe_down_kernel,
        dict(aq_ptr=f8, as_ptr=f32, ids_ptr="*i64", n_live_ptr=i32, proj_ptr=f8, ps_ptr=f32,
             y_ptr=f32, w_ptr=f32, out_ptr=f32, cnt_ptr=i32, gu_ptr=f32),
        dict(tp8, BLOCK_N=cfg.down_block_n, stride_pk=1, stride_ik=1, FOLD=True,
             SILU=False, KS=1, OUT_BF16=False, EARLY=False),
        dict(num_warps=cfg.down_warps, num_stages=cfg.down_stages),
        ["aq_ptr", "as_ptr", "ids_ptr", "proj_ptr", "ps_ptr", "y_ptr", "stride_aqr", "stride_pe",
         "stride_pn", "stride_yr"]),
    "down_silu": build(moe._moe_down_kernel,
        dict(aq_ptr=f8, as_ptr=f32, ids_ptr="*i64", n_live_ptr=i32, proj_ptr=f8, ps_ptr=f32,
             y_ptr=f32, w_ptr=f32, out_ptr=f32, cnt_ptr=i32, gu_ptr=f32),
        dict(tp8, BLOCK_N=cfg.down_block_n, stride_pk=1, stride_ik=1, FOLD=False,
             SILU=True, KS=cfg.k_splits(3072), OUT_BF16=False, EARLY=False),
        dict(num_warps=cfg.down_warps, num_stages=cfg.down_stages),
        ["ids_ptr", "proj_ptr", "ps_ptr", "y_ptr", "gu_ptr", "stride_pe", "stride_pn",
         "stride_yr", "stride_gj", "stride_gs"]),
    "combine": build(moe._moe_combine_kernel,
        dict(y_ptr=f32, w_ptr=f32, n_live_ptr=i32, out_ptr="*bf16"),
        dict(K=8, BLOCK_H=cfg.combine_block_h, OUT_BF16=True, PDL=False), dict(num_warps=4),
        []),
}
for name, fold, hoist, early in (("gate_up", True, False, False),
                                 ("gate_up_hoist", False, True, False),
                                 ("gate_up_pinned", False, False, False),
                                 ("gate_up_early", False, False, True),
                                 ("gate_up_trace", False, False, False),
                                 ("gate_up_compact", False, False, False)):
    out[name] = build(moe._moe_gate_up_kernel,
        dict(xq_ptr=f8, xs_ptr=f32, ids_ptr=i32, n_live_ptr=i32, fc_ptr=f8, fcs_ptr=f32, p_ptr=f32,
             cnt_ptr=i32, a_ptr=f32, aq_ptr=f8, as_ptr=f32, trace_ptr="*i64"),
        dict(tp8, BLOCK_N=cfg.gate_up_block_n, K_BLOCKS=cfg.gate_up_k_blocks, stride_fk=1,
             stride_ik=1, FOLD=fold, KS=cfg.k_splits(3072), GROUPS=2, QUANT=True, HOIST=hoist,
             EARLY=early, TRACE=name == "gate_up_trace", COMPACT=name == "gate_up_compact"),
        dict(num_warps=cfg.gate_up_warps, num_stages=cfg.gate_up_stages),
        ["xq_ptr", "xs_ptr", "ids_ptr", "fc_ptr", "fcs_ptr", "p_ptr", "stride_xqr", "stride_fe",
         "stride_fn", "stride_pj", "stride_ps"])
# the row-major down with SiLU·up recomputed from the gate/up partials (silu_in_down): at the
# stages its GPU test runs (2, SILU_ROWS_STAGES) and at the pinned launch's
for name, stages in (("down_rows", 2), ("down_rows_silu_pinned_stages", cfg.down_stages)):
    out[name] = build(moe._moe_down_rows_kernel,
        dict(aq_ptr=f32, as_ptr=f32, gu_ptr=f32, ids_ptr="*i64", n_live_ptr=i32, proj_ptr=f8,
             ps_ptr=f32, w_ptr=f32, out_ptr="*bf16"),
        dict(H=3072, I=192, K=8, BLOCK_R=16, PDL=False, BLOCK_N=cfg.down_block_n, stride_pk=1,
             stride_ik=1, SILU=True, KS=cfg.k_splits(3072), OUT_BF16=True, HOIST=False,
             EARLY=False, IDS_AHEAD=cfg.down_ids_ahead, TRACE=False, SCALES_AHEAD=False),
        dict(num_warps=cfg.down_warps, num_stages=stages),
        ["ids_ptr", "proj_ptr", "ps_ptr", "gu_ptr", "w_ptr", "out_ptr", "stride_pe",
         "stride_pn", "stride_gj", "stride_gs", "stride_or"])
# the row-major down on aq, sa: ids and scales in the loop, hoisted, hoisted and loaded early,
# traced; with 4 and with 3 stages; the ids ahead of the loop (the pinned H200 launch)
for name, hoist, early, trace, stages, ahead in (
        ("aq", False, False, False, 2, False), ("hoist", True, False, False, 2, False),
        ("hoist_early", True, True, False, 2, False), ("trace", False, False, True, 2, False),
        ("aq_s4", False, False, False, 4, False), ("hoist_s3", True, False, False, 3, False),
        ("hoist_s4", True, False, False, 4, False),
        ("pinned", False, False, False, cfg.down_stages, cfg.down_ids_ahead),
        ("ahead_s3_trace", False, False, True, 3, True),
        ("hoist_s3_trace", True, False, True, 3, False),
        ("hoist_early_s3_trace", True, True, True, 3, False),
        ("scales_ahead_s3", False, False, False, 3, "scales"),
        ("scales_ahead_s3_trace", False, False, True, 3, "scales")):
    out[f"down_rows_{name}"] = build(moe._moe_down_rows_kernel,
        dict(aq_ptr=f8, as_ptr=f32, gu_ptr=f32, ids_ptr="*i64", n_live_ptr=i32, proj_ptr=f8,
             ps_ptr=f32, w_ptr=f32, out_ptr="*bf16", trace_ptr="*i64"),
        dict(H=3072, I=192, K=8, BLOCK_R=16, PDL=False, BLOCK_N=cfg.down_block_n, stride_pk=1,
             stride_ik=1, SILU=False, KS=1, OUT_BF16=True, HOIST=hoist, EARLY=early,
             IDS_AHEAD=bool(ahead), TRACE=trace, SCALES_AHEAD=ahead == "scales"),
        dict(num_warps=cfg.down_warps, num_stages=stages),
        ["aq_ptr", "ids_ptr", "proj_ptr", "ps_ptr", "w_ptr", "out_ptr", "stride_aqr",
         "stride_pe", "stride_pn", "stride_or"])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_moe_kernels_compile_for_sm90():
    """Without a GPU: compile the TP8-configured kernels for sm_90 with Triton's own ptxas, with
    the alignment Triton's JIT infers at run time; the weight loads must stream through cp.async
    pipelines and both GEMMs reach tensor cores (with the pinned 2 warps that is mma.sync:
    wgmma needs a warp group of 4, and 2 warps measured faster on the H200:
    reports/benchmarks/h200-2026-12-01/session9/exp_router_moe_call2.log)."""
    got = compile_sm90(SM90_COMPILE)
    print(f"\n  sm_90 PTX: {got}")
    assert got["gate_up"]["cp.async"] > 0 and got["down"]["cp.async"] > 0, "loads not pipelined"
    for name in ("gate_up", "down"):
        assert got[name]["wgmma"] + got[name]["mma.sync"] > 0, f"{name}: no tensor-core MMA"
    assert got["silu"]["ex2"] > 0
    # MoeLaunch.silu_prefetch: launch 3 asks L2 for proj[e] after its PDL wait (it reads the
    # routing ids), and only then; the pinned SiLU prefetches nothing
    pf, key = got["silu_prefetch"], "prefetch.global.L2::evict_last"
    assert pf[key] >= 1 and pf["prefetch_after_wait"] == 1 and got["silu"][key] == 0, pf
    assert pf["ex2"] == got["silu"]["ex2"]
    # the folded variants (kept, off by default): the arrival counter and SiLU's exp are there
    assert got["gate_up"]["atom.global.gpu.acq_rel"] == 1 and got["gate_up"]["ex2"] > 0
    assert got["gate_up"]["ld.volatile.global"] > 0  # the partials other programs wrote
    # and the combine into down: one counter per live row routed to the expert, volatile y
    assert got["down"]["atom.global.gpu.acq_rel"] == 1 and got["down"]["ld.volatile.global"] > 0
    # SiLU recomputed in down: its exp is there, the weights still stream through cp.async into
    # tensor-core MMAs, and nothing waits on another program
    ds = got["down_silu"]
    assert ds["ex2"] > 0 and ds["cp.async"] > 0 and ds["wgmma"] + ds["mma.sync"] > 0
    assert ds["atom.global.gpu.acq_rel"] == 0 and ds["ld.volatile.global"] == 0
    dr = got["down_rows"]  # and row-major down + combine, the same
    assert dr["ex2"] > 0 and dr["cp.async"] > 0 and dr["wgmma"] + dr["mma.sync"] > 0
    assert dr["atom.global.gpu.acq_rel"] == 0 and dr["ld.volatile.global"] == 0
    # the hoists: the pipelined loops wait on cp.async tiles only, where the loops they replace
    # load scales (and down's expert ids and router weights) synchronously after each wait
    assert got["gate_up"]["loop_loads"] >= 3 and got["down_rows_aq"]["loop_loads"] >= 4
    for name in ("gate_up_hoist", "down_rows_hoist"):
        h = got[name]
        assert h["loop_loads"] == 0 and h["cp.async"] > 0 and h["mma.sync"] > 0, name
    # early loads (ptxas's SASS): the first expert-weight tile waits for one global round trip
    # (the ids, issued beside n_live), where the pinned launches chain n_live → ids (→ ids)
    assert got["gate_up_pinned"]["trips"] >= 3 and got["gate_up_early"]["trips"] == 1
    assert got["down_rows_hoist"]["trips"] >= 2 and got["down_rows_hoist_early"]["trips"] == 1
    assert got["gate_up_early"]["mma.sync"] > 0 and got["down_rows_hoist_early"]["mma.sync"] > 0
    # which loops overlap their tile loads with their MMAs (cp.async groups left in flight by
    # the loop's wait): gate/up at its 3 stages does; the row-major down with its expert id
    # loaded in the loop never does, at any stage count (Triton issues expert k+1's tiles after
    # expert k's MMAs, single-buffered, and waits for all of them); hoisted, it keeps one
    # expert's tiles (2 blocks × operand + weight) in flight at 3 stages, two at 4
    assert got["gate_up_pinned"]["in_flight"] > 0
    # the compact gate/up (gate_up_compact): its K loop pipelined like the slot grid's, into
    # tensor-core MMAs, no arrival counters, the same shared memory
    gp = got["gate_up_compact"]
    assert gp["in_flight"] == got["gate_up_pinned"]["in_flight"] and gp["mma.sync"] > 0, gp
    assert gp["atom.global.gpu.acq_rel"] == 0 and gp["smem"] == got["gate_up_pinned"]["smem"]
    assert got["down_rows_aq"]["in_flight"] == 0 and got["down_rows_aq_s4"]["in_flight"] == 0
    assert got["down_rows_hoist"]["in_flight"] == 0  # 2 stages: single-buffered
    assert got["down_rows_hoist_s3"]["in_flight"] == 4
    assert got["down_rows_hoist_s4"]["in_flight"] == 8
    # with only the ids ahead of the loop (the scales still loaded in it, 3 stages: the pinned
    # launch) the same, traced too
    for name in ("down_rows_pinned", "down_rows_ahead_s3_trace"):
        assert got[name]["in_flight"] == 4 and got[name]["loop_loads"] >= 3, name
    # every pinned launch fits an sm_90 SM's shared memory (227 KB per block); the row-major
    # down with SiLU·up recomputed in it does at 2 stages but not at the pinned 3 (each stage
    # holds the gate/up partials' tiles): its GPU test runs it at SILU_ROWS_STAGES
    for name in ("gate_up_pinned", "silu", "down_rows_pinned", "combine", "down_rows"):
        assert got[name]["smem"] <= SM90_SMEM, (name, got[name]["smem"])
    assert got["down_rows_silu_pinned_stages"]["smem"] > SM90_SMEM
    # the traced row-major down and gate/up (moe_fp8 trace=…, gate_up_trace=…): their stamps
    # read the global timer (start, past the exit, per expert or block, after the store), the
    # same pipelined loops; untraced, none do
    for name in ("down_rows_trace", "gate_up_trace"):
        tr = got[name]
        assert tr["%globaltimer"] >= 4 and tr["cp.async"] > 0 and tr["mma.sync"] > 0, name
    # a pass of the pinned down's expert loop waits 6 times for the scales and router weight it
    # loads itself — block 0's after its first MMAs, then block 1's, then the router weight:
    # round trips in series, ≈ the 1.1–1.3 µs per expert of the H200's stamps; hoisted, never;
    # with the scales one expert ahead (down_scales_ahead) 3 times, all for loads issued at the
    # pass's top: once where a tile read (LDSM) shares their scoreboard, mid-pass, and where the
    # carried registers are refilled, at its end; the same tiles in flight
    pinned, ahead = got["down_rows_pinned"], got["down_rows_scales_ahead_s3"]
    assert pinned["own_waits"] >= 3 and got["down_rows_hoist_s3"]["own_waits"] == 0, pinned
    assert ahead["own_waits"] < pinned["own_waits"] and ahead["in_flight"] == pinned["in_flight"]
    assert ahead["mma.sync"] > 0 and ahead["smem"] == pinned["smem"], ahead
    assert got["down_rows_scales_ahead_s3_trace"]["%globaltimer"] >= 4
    # the hoisted down traced (exp_moe_timeline --variant down_hoist=1,down_stages=3): its
    # stamps, and still no synchronous load in the loop and one expert's tiles in flight
    for name in ("down_rows_hoist_s3_trace", "down_rows_hoist_early_s3_trace"):
        tr = got[name]
        assert tr["%globaltimer"] >= 4 and tr["loop_loads"] == 0, (name, tr)
        assert tr["in_flight"] == got["down_rows_hoist_s3"]["in_flight"], (name, tr)
    assert all(g["%globaltimer"] == 0 for name, g in got.items() if not name.endswith("trace"))


# --- GPU only: per-rank TP8 shapes, CUDA graphs, no host sync ----------------------------------

TP8 = dict(hidden=3072, experts=256, top_k=8, inter=192)


@pytest.mark.gpu
@pytest.mark.parametrize("n_live", [1, 6, 8])
def test_moe_tp8_matches_twin(n_live, device):
    case = Case(f"tp8-{n_live}of8", **TP8, rows=8, n_live=n_live)
    report = run_case(case, seed=500 + n_live, device=device)
    for key, val in report.items():
        print(f"  {key}: {val}")


@pytest.mark.gpu
@pytest.mark.parametrize("n_live", [1, 6, 8])
def test_moe_tp8_folded_launches_give_the_unfolded_bits(n_live, device):
    """On the GPU the folded programs really run concurrently: the arrival counters must order
    every partial and every y before the program that reads them. 20 graph replays of the
    folded launch give the unfolded launches' bits each time; counters end at 0."""
    case = Case(f"tp8-fold-{n_live}of8", **TP8, rows=8, n_live=n_live)
    d = to_dev(make_inputs(case, 600 + n_live), device)
    cfg = dataclasses.replace(separate(moe_launch(3072, 192)), fold_silu=True, fold_combine=True)
    args = (d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)
    unfolded = dataclasses.replace(cfg, fold_silu=False, fold_combine=False)
    want = moe_fp8(*args, config=unfolded)[:n_live].view(torch.int16).clone()
    scratch = MoeScratch.create(device)
    out = poisoned((8, 3072), torch.bfloat16, device)
    moe_fp8(*args, config=cfg, scratch=scratch, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        moe_fp8(*args, config=cfg, scratch=scratch, out=out)
    for i in range(20):
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:n_live].view(torch.int16), want), f"replay {i}"
    assert int(scratch.counters.abs().sum()) == 0


def assert_replays_give(args, cfg: MoeLaunch, want, n_live: int, device, replays: int = 10):
    """moe_fp8(*args, config=cfg) captured in a CUDA graph gives want's bits on every replay
    into a poisoned output."""
    out = poisoned((8, 3072), torch.bfloat16, device)
    moe_fp8(*args, config=cfg, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        moe_fp8(*args, config=cfg, out=out)
    for i in range(replays):
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:n_live].view(torch.int16), want), f"replay {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("moved", MOVED, ids=lambda m: "silu{}-fold{}-rows{}".format(*map(int, m)))
@pytest.mark.parametrize("n_live", [1, 6, 8])
def test_moe_tp8_moved_launches_give_the_separate_bits(n_live, moved, device):
    """The pinned TP8 launch (4 K splits, I = 192) with SiLU recomputed in down and/or down +
    combine row-major == launches 3, 4, 5 one after another, bit for bit (compiled: MMA and
    FMA contraction as in production), over 10 graph replays."""
    case = Case(f"tp8-moved-{n_live}of8", **TP8, rows=8, n_live=n_live)
    d = to_dev(make_inputs(case, 620 + n_live), device)
    cfg = separate(moe_launch(3072, 192))
    args = (d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)
    want = moe_fp8(*args, config=cfg)[:n_live].view(torch.int16).clone()
    on = dataclasses.replace(cfg, silu_in_down=moved[0], fold_combine=moved[1],
                             down_rows=moved[2])
    if on.silu_in_down and on.down_rows:
        on = dataclasses.replace(on, down_stages=SILU_ROWS_STAGES)
    assert_replays_give(args, on, want, n_live, device)


@pytest.mark.gpu
@pytest.mark.parametrize("hoisted", [False, True], ids=["pinned", "down_hoist_s3"])
def test_moe_tp8_traced_down_gives_the_same_bits_and_ordered_stamps(hoisted, device):
    """moe_fp8(trace=…, gate_up_trace=…) at the pinned TP8 launch, and with the down's loop
    hoisted at 3 stages (exp_moe_timeline's variant): the untraced bits; per live down program
    (row, hidden tile) its stamps in program order — start ≤ past the exit ≤ expert 0 ≤ … ≤
    expert 7 ≤ stored — on its SM, padding rows' programs only their start; per gate/up program
    of a routed expert's lead slot start ≤ exit ≤ each block ≤ stored."""
    from kernels.timeline import SM_SLOT, new_trace

    n_live = 6
    case = Case("tp8-trace-6of8", **TP8, rows=8, n_live=n_live)
    d = to_dev(make_inputs(case, 660), device)
    cfg = moe_launch(3072, 192)
    if hoisted:
        cfg = dataclasses.replace(cfg, down_hoist=True, down_stages=3)
    args = (d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)
    want = moe_fp8(*args, config=cfg)[:n_live].view(torch.int16).clone()
    tiles = -(-3072 // cfg.down_block_n)
    trace = new_trace(8 * tiles, device)
    ks, gu_tiles = cfg.k_splits(3072), -(-192 // cfg.gate_up_block_n)
    gu = new_trace(8 * 8 * gu_tiles * ks, device)
    got = moe_fp8(*args, config=cfg, trace=trace, gate_up_trace=gu)[:n_live].view(torch.int16)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    t = trace.cpu().view(8, tiles, -1)
    live, pad = t[:n_live], t[n_live:]
    steps = live[..., :11]  # slots 0 … 10
    assert (steps > 0).all() and (steps[..., 1:] >= steps[..., :-1]).all()
    assert (pad[..., 0] > 0).all() and (pad[..., 1:SM_SLOT] == 0).all()
    assert ((t[..., SM_SLOT] >= 0) & (t[..., SM_SLOT] < 1024)).all()
    # gate/up: the programs of each routed expert's lead slot pass the exit and stamp every
    # block of their split in order; the others stamp their start only
    g = gu.cpu().view(8 * 8, gu_tiles, ks, -1)
    passed = g[..., 1] > 0
    leads = len(set(d.ids[:n_live].flatten().tolist()))
    assert int(passed.all(dim=(1, 2)).sum()) == leads and not (passed.any(dim=(1, 2))
                                                               & ~passed.all(dim=(1, 2))).any()
    blocks = cfg.k_blocks(3072)
    done = g[passed][:, [0, 1, *range(2, 2 + min(blocks, 8)), 10]]
    assert (done[:, 1:] >= done[:, :-1]).all() and (done > 0).all()
    assert (g[~passed][:, 1:SM_SLOT] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("hoist", HOISTS, ids=hoist_label)
@pytest.mark.parametrize("n_live", [1, 6, 8])
def test_moe_tp8_hoisted_loads_give_the_same_bits(n_live, hoist, device):
    """The pinned TP8 launch with ids, router weights and scales hoisted out of the loops, or
    the routing loaded before n_live arrives (early_loads), == the pinned loads, bit for bit
    (compiled, pipelined), over 10 graph replays."""
    case = Case(f"tp8-hoist-{n_live}of8", **TP8, rows=8, n_live=n_live)
    d = to_dev(make_inputs(case, 640 + n_live), device)
    cfg = dataclasses.replace(moe_launch(3072, 192), down_hoist=False, gate_up_hoist=False)
    args = (d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)
    want = moe_fp8(*args, config=cfg)[:n_live].view(torch.int16).clone()
    on = dataclasses.replace(cfg, **hoist)
    assert_replays_give(args, on, want, n_live, device)


@pytest.mark.gpu
@pytest.mark.parametrize("n_live", [1, 6, 8])
def test_moe_tp8_compact_gate_up_gives_the_same_bits(n_live, device):
    """The pinned TP8 launch with the compact gate/up grid (MoeLaunch.gate_up_compact) == the
    slot grid, bit for bit (compiled, pipelined), over 10 graph replays."""
    case = Case(f"tp8-compact-{n_live}of8", **TP8, rows=8, n_live=n_live)
    d = to_dev(make_inputs(case, 660 + n_live), device)
    cfg = moe_launch(3072, 192)
    args = (d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, d.n)
    want = moe_fp8(*args, config=cfg)[:n_live].view(torch.int16).clone()
    assert_replays_give(args, dataclasses.replace(cfg, gate_up_compact=True), want, n_live,
                        device)


@pytest.mark.gpu
def test_moe_cuda_graph_and_no_host_sync(device):
    case = Case("tp8-graph", **TP8, rows=8, n_live=8)
    inp = make_inputs(case, 77)
    d = to_dev(inp, device)
    n = torch.tensor([8], dtype=torch.int32, device=device)
    out = poisoned((8, 3072), torch.bfloat16, device)
    moe_fp8(d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, n, out=out)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_fp8(d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, n, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        moe_fp8(d.x, d.weights, d.ids, d.fc, d.fc_s, d.proj, d.proj_s, n, out=out)
    for live in (3, 8, 1):
        out.fill_(POISON)
        n.fill_(live)
        graph.replay()
        torch.cuda.synchronize()
        assert_live_written_pad_untouched(out, live, f"graph replay n={live}")
        twin = moe_fp8_ref(inp.x, inp.weights, inp.ids, inp.fc, inp.fc_s, inp.proj, inp.proj_s,
                           torch.tensor([live]))
        check(out.cpu()[:live], twin, "kernels.moe.e2e", "bf16")


@pytest.mark.gpu
def test_bench_moe_tp8(benchmark):
    """6 live rows, 44 distinct experts; a graph of 20 calls over 5 disjoint routing sets (390 MB
    of weights cycled, ≫ L2). Divide the reported time by 20 for one call."""
    from benchmarks.bench_moe import BenchSpec, build_problem, capture_graph, kernel_call

    problem = build_problem(BenchSpec(rows=6, distinct=44), torch.device("cuda"))
    calls = [kernel_call(problem, 0, j) for j in range(problem.sets)]
    graph = capture_graph(calls, reps=20)

    def step():
        graph.replay()
        torch.cuda.synchronize()

    benchmark(step)
