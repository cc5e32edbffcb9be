"""kernels/linear.py against its twins (reference/twins/linear.py): block-FP8 and BF16 dense
projections, split-K partials and their pinned-order reduction.

Two kinds of inputs:
  snapped — x is integer E4M3 codes (|c| ≤ 16) with one ±448 per 128-column group, × 2^p per
            group (its act-quant is lossless); W is integer codes, half zero, × 2^e per 128×128
            block with neighbouring blocks 4× apart. Every product and partial sum is an integer
            multiple of 2^-9 below 2^24·2^-9, so FP32 accumulation is exact in any order and the
            kernel must equal the twin bit for bit (asserted: the FP32 twin equals FP64).
  random  — Gaussian x with per-group magnitudes 2^±6, quantize_block of Gaussian W: the
            tolerance rows of qualification/tolerances.py ("# kernels/linear rows").
Outputs are poisoned with NaN; padding rows of x hold NaN and 1e30 and must never leak.

Dimension letters: R buffer rows, n live rows, K input columns, N output channels, S splits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from iquestrt.capture import graph_capture
from kernels.fp8 import E4M3
from kernels.linear import (
    LinearLaunch,
    linear_bf16_f32,
    linear_fp8,
    linear_fp8_launch,
    linear_fp8_partials,
    linear_fp8_splits,
    split_plan,
)
from qualification.tolerances import check, grid_steps, tolerance
from reference import ops
from reference.twins.linear import (
    linear_bf16_f32_ref,
    linear_fp8_partials_ref,
    linear_fp8_ref,
    reduce_splits_ref,
)
from tests.kernels.sm90 import compile_sm90

NAN = float("nan")


@dataclass(frozen=True)
class Case:
    name: str
    rows: int  # buffer R
    n_live: int
    k: int
    n: int
    config: LinearLaunch | None = None
    x_dtype: torch.dtype = torch.bfloat16
    strided: bool = False  # x and W as non-contiguous views


CASES = (
    Case("r1-k128-n64", 1, 1, 128, 64),
    Case("r3-k200-n99", 3, 3, 200, 99, LinearLaunch(32, 2)),  # partial K block, partial tile
    Case("r8of5-k200-n99", 8, 5, 200, 99, LinearLaunch(32, 1)),
    Case("r8-k384-n160-s3", 8, 8, 384, 160, LinearLaunch(64, 3)),  # partial N scale block
    Case("r4of2-k256-n19-strided", 4, 2, 256, 19, LinearLaunch(16, 2), torch.float32, True),
    Case("tiny-qkv-r8of6", 8, 6, 128, 512),  # tiny preset QKV, default launch
    Case("tiny-down-r6of6", 6, 6, 256, 128, None, torch.float16),
)


# --- inputs ------------------------------------------------------------------------------------


def signs(shape, gen) -> torch.Tensor:
    return torch.randint(2, shape, generator=gen).float() * 2 - 1


def snapped_x(r: int, k: int, gen) -> torch.Tensor:
    x = torch.randint(0, 17, (r, k), generator=gen).float() * signs((r, k), gen)
    groups = -(-k // 128)
    for g in range(groups):
        cols = torch.randint(g * 128, min(k, g * 128 + 128), (r,), generator=gen)
        x[torch.arange(r), cols] = 448.0 * signs((r,), gen)
    p = torch.randint(-3, -1, (r, groups), generator=gen).float()
    return x * torch.exp2(p).repeat_interleave(128, dim=1)[:, :k]


def snapped_w(n: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(1, 17, (n, k), generator=gen).float() * signs((n, k), gen)
    codes = codes * (torch.rand(n, k, generator=gen) < 0.5)
    nb, kb = -(-n // 128), -(-k // 128)
    grid = (torch.arange(nb)[:, None] + torch.arange(kb)[None, :]) % 2 * 2 - 1  # ±1 checkerboard
    return codes.to(E4M3), torch.exp2(-5.0 + grid.float())


def random_x(r: int, k: int, gen) -> torch.Tensor:
    mag = torch.exp2(torch.randint(-6, 7, (r, -(-k // 128)), generator=gen).float())
    return torch.randn(r, k, generator=gen) * mag.repeat_interleave(128, dim=1)[:, :k]


def random_w(n: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_block of Gaussian W with magnitudes 2^[-4, 4) per row and 2^[-2, 2] per
    128-column block (so neighbouring scale blocks differ, as in trained weights)."""
    row = torch.exp2(torch.randint(-4, 4, (n, 1), generator=gen).float())
    col = torch.exp2(torch.randint(-2, 3, (1, -(-k // 128)), generator=gen).float())
    w = torch.randn(n, k, generator=gen) * row * col.repeat_interleave(128, dim=1)[:, :k]
    return ops.quantize_block(w)


def with_garbage(x: torch.Tensor, n: int, dtype) -> torch.Tensor:
    x = x.clone()
    x[n:] = NAN
    x[n:, 0] = 1e30
    return x.to(dtype)


def place(t: torch.Tensor, device, strided: bool) -> torch.Tensor:
    """t on device, as a view with a padded row stride (and offset) when strided."""
    t = t.to(device)
    if not strided:
        return t
    wide = torch.zeros(t.shape[0], t.shape[1] + 37, dtype=t.dtype, device=device)
    wide[:, 5 : 5 + t.shape[1]] = t
    view = wide[:, 5 : 5 + t.shape[1]]
    assert not view.is_contiguous()
    return view


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu().contiguous()
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


# quiet NaNs with a payload no arithmetic produces (GPU: 0x7FFFFFFF, numpy/torch: 0x7FC00000)
POISON_BITS = {torch.bfloat16: (torch.int16, 0x7FE5), torch.float32: (torch.int32, 0x7FC0BEEF)}


def poisoned(shape, dtype, device) -> torch.Tensor:
    int_dtype, pattern = POISON_BITS[dtype]
    return torch.full(shape, pattern, dtype=int_dtype, device=device).view(dtype)


def assert_live_written_pad_untouched(out: torch.Tensor, live: int, what: str) -> None:
    """[..., R, N]: live rows hold no NaN (all written, garbage never leaked); padding rows keep
    the poison's exact bits (a write of anything, NaN included, would change them)."""
    assert not torch.isnan(out.cpu()[..., :live, :]).any(), f"{what}: live rows not fully written"
    pad = bits(out[..., live:, :])
    assert (pad == POISON_BITS[out.dtype][1]).all(), f"{what}: padding rows were written"


def fails(fn) -> str:
    with pytest.raises(AssertionError) as err:
        fn()
    return str(err.value).split(";")[0]


def inputs(case: Case, seed: int, snapped: bool):
    gen = torch.Generator().manual_seed(seed)
    x = snapped_x(case.rows, case.k, gen) if snapped else random_x(case.rows, case.k, gen)
    w, s = (snapped_w if snapped else random_w)(case.n, case.k, gen)
    return with_garbage(x, case.n_live, case.x_dtype), w, s, torch.tensor([case.n_live],
                                                                        dtype=torch.int32)


# --- block FP8 ---------------------------------------------------------------------------------


def run_fp8(case: Case, seed: int, snapped: bool, device) -> dict[str, object]:
    x, w, s, n = inputs(case, seed, snapped)
    xd, wd = place(x, device, case.strided), place(w, device, case.strided)
    sd, nd = s.to(device), n.to(device)
    live, cfg, report = case.n_live, case.config, {}
    if snapped:  # the claim that makes the exact rows meaningful
        ref64 = ops.dequant_act(*ops.quantize_act(x[:live].float())).double() @ \
            ops.dequant_block(w, s).double().t()
        assert torch.equal(linear_fp8_ref(x, w, s, n, out_dtype=torch.float32).double(), ref64)
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        out = linear_fp8(xd, wd, sd, nd, out_dtype=dtype, config=cfg,
                         out=poisoned((case.rows, case.n), dtype, device))
        assert_live_written_pad_untouched(out, live, f"linear_fp8 out ({dtype})")
        twin = linear_fp8_ref(x, w, s, n, out_dtype=dtype)
        got = outs[dtype] = out.cpu()[:live]
        if snapped:
            report[f"out {dtype}"] = check(got, twin, "kernels.linear_fp8.snapped", "fp32")
        elif dtype == torch.float32:
            report["out fp32"] = check(got, twin, "kernels.linear_fp8", "fp32")
        else:
            report["out bf16"] = check(got, twin, "kernels.linear_fp8", "bf16")
            ulps = grid_steps(got, twin, "bf16")  # > 1 only where |y| ≪ max|y| (cancellation)
            report["bf16 ulp flips"] = (f"{int((ulps > 0).sum())} of {ulps.numel()}, "
                                        f"max {int(ulps.max())}")
    # the bf16 output is the RNE of the same FP32 sum
    check(bits(outs[torch.bfloat16]), bits(outs[torch.float32].bfloat16()),
          "kernels.linear.bit_exact", "bf16")
    splits = linear_fp8_splits(case.n, case.k, cfg)
    part = linear_fp8_partials(xd, wd, sd, nd, config=cfg,
                               out=poisoned((splits, case.rows, case.n), torch.float32, device))
    assert_live_written_pad_untouched(part, live, "linear_fp8_partials")
    twin = linear_fp8_partials_ref(x, w, s, n, splits=splits)
    row = "kernels.linear_fp8.snapped" if snapped else "kernels.linear_fp8"
    report[f"partials S={splits}"] = check(part.cpu()[:, :live], twin, row, "fp32")
    return report


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("snapped", [True, False], ids=["snapped", "random"])
def test_linear_fp8_matches_twin(case, snapped, device):
    report = run_fp8(case, 10 + CASES.index(case), snapped, device)
    for key, val in report.items():
        print(f"\n  [{case.name}] {key}: {val}")


@pytest.mark.slow
def test_split_k_deterministic_and_consistent(device):
    """Reruns give the same bits (no atomics, pinned order); split counts 1, 2, 3 agree within
    the FP32 accumulation row; S > 1 really runs the partial + reduce path."""
    gen = torch.Generator().manual_seed(21)
    x = with_garbage(random_x(8, 640, gen), 7, torch.bfloat16).to(device)  # 5 column blocks
    w, s = random_w(99, 640, gen)
    w, s, n = w.to(device), s.to(device), torch.tensor([7], dtype=torch.int32, device=device)
    runs = {}
    for split in (1, 2, 3):
        cfg = LinearLaunch(32, split)
        assert linear_fp8_splits(99, 640, cfg) == split
        a = linear_fp8(x, w, s, n, out_dtype=torch.float32, config=cfg)[:7]
        b = linear_fp8(x, w, s, n, out_dtype=torch.float32, config=cfg)[:7]
        assert torch.equal(bits(a), bits(b)), f"split {split}: rerun changed bits"
        runs[split] = a.cpu()
    for split in (2, 3):
        m = check(runs[split], runs[1], "kernels.linear_fp8", "fp32")
        print(f"\n  split {split} vs 1: {m}")


def test_prequantized_operand_gives_the_same_bits(device):
    """linear_fp8_partials(quantized=quantize_act(x)) == linear_fp8_partials(x) bit for bit (a
    producer quantized x: kernels/tails.py moe_tail); wrong scales change the result; a
    quantized pair of the wrong shape or dtype is named."""
    from kernels.fp8 import quantize_act

    gen = torch.Generator().manual_seed(23)
    x = with_garbage(random_x(8, 640, gen), 6, torch.bfloat16).to(device)
    w, s = random_w(99, 640, gen)
    w, s, n = w.to(device), s.to(device), torch.tensor([6], dtype=torch.int32, device=device)
    cfg = LinearLaunch(32, 3)
    want = linear_fp8_partials(x, w, s, n, config=cfg)[:, :6]
    xq, sx = quantize_act(x, n)
    got = linear_fp8_partials(x, w, s, n, config=cfg, quantized=(xq, sx))[:, :6]
    assert torch.equal(bits(got), bits(want))
    off = linear_fp8_partials(x, w, s, n, config=cfg, quantized=(xq, sx * 2))[:, :6]
    assert not torch.equal(bits(off), bits(want))
    for bad, words in (((xq[:, :128], sx), "quantized\\[0\\]"),
                       ((xq, sx[:, :2]), "quantized\\[1\\]"),
                       ((xq.view(torch.uint8), sx), "quantized\\[0\\]")):
        with pytest.raises(ValueError, match=words):
            linear_fp8_partials(x, w, s, n, config=cfg, quantized=bad)


HOIST_CASES = (CASES[1], CASES[3], CASES[4],
               Case("r8of7-k640-n99-s3", 8, 7, 640, 99, LinearLaunch(32, 3)))  # last split short


# the load placements that must not change a bit (LinearLaunch fields over the pinned launch)
MOVED = ({"hoist_scales": True}, {"early_loads": True},
         {"hoist_scales": True, "early_loads": True})


def hoisted(cfg: LinearLaunch | None, n: int, k: int, **moved) -> LinearLaunch:
    return dataclasses.replace(cfg or linear_fp8_launch(n, k), **(moved or MOVED[0]))


@pytest.mark.parametrize("case", HOIST_CASES, ids=lambda c: c.name)
def test_hoisted_scales_give_the_same_bits(case, device):
    """The split's scales loaded before the K loop (LinearLaunch.hoist_scales), and x read for
    every buffer row without waiting for n_live (early_loads), == the pinned loads, bit for
    bit: partials and bf16 output, partial K and N scale blocks, 1–3 splits, a last split
    shorter than the others (its loop runs past K, masked), strided operands; the scales differ
    per block (random_w), so a block picked wrong shows; padding rows hold NaN and 1e30
    (`inputs`), so a padding row read into a live row's output shows."""
    x, w, s, n = inputs(case, 31, snapped=False)
    xd, wd = place(x, device, case.strided), place(w, device, case.strided)
    sd, nd = s.to(device), n.to(device)
    live = case.n_live

    def run(cfg):
        splits = linear_fp8_splits(case.n, case.k, cfg)
        part = linear_fp8_partials(xd, wd, sd, nd, config=cfg, out=poisoned(
            (splits, case.rows, case.n), torch.float32, device))
        out = linear_fp8(xd, wd, sd, nd, config=cfg,
                         out=poisoned((case.rows, case.n), torch.bfloat16, device))
        assert_live_written_pad_untouched(part, live, f"partials {cfg}")
        assert_live_written_pad_untouched(out, live, f"out {cfg}")
        return bits(part[:, :live]), bits(out[:live])

    want = run(case.config)
    for moved in MOVED:
        got = run(hoisted(case.config, case.n, case.k, **moved))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), moved


def test_weight_prefetch_needs_pdl(device):
    """LinearLaunch.prefetch_w prefetches before the PDL wait: without PDL it is refused before
    any launch (quantization included), in both wrappers and the folded QKV launch."""
    case = CASES[1]
    x, w, s, n = (t.to(device) for t in inputs(case, 33, snapped=False))
    cfg = dataclasses.replace(case.config or linear_fp8_launch(case.n, case.k), prefetch_w=True)
    for fn in (linear_fp8, linear_fp8_partials):
        with pytest.raises(ValueError, match="prefetch_w: .* needs pdl=True"):
            fn(x, w, s, n, config=cfg)


def test_padded_width_is_bit_identical(device):
    """5 live rows in an 8-row buffer give exactly the bits of a 5-row buffer."""
    case = Case("pad", 8, 5, 200, 99, LinearLaunch(32, 2))
    x, w, s, n = inputs(case, 4, snapped=False)
    xd, wd, sd = x.to(device), w.to(device), s.to(device)
    padded = linear_fp8(xd, wd, sd, n.to(device), config=case.config)[:5]
    exact = linear_fp8(xd[:5].contiguous(), wd, sd, config=case.config)
    check(bits(padded), bits(exact), "kernels.linear.bit_exact", "bf16")
    wb = torch.randn(99, 200, generator=torch.Generator().manual_seed(5)).bfloat16().to(device)
    xb = x.bfloat16().to(device)
    padded = linear_bf16_f32(xb, wb, n.to(device))[:5]
    check(bits(padded), bits(linear_bf16_f32(xb[:5].contiguous(), wb)),
          "kernels.linear.bit_exact", "fp32")


def test_zero_live_rows_write_nothing(device):
    x, w, s, _ = inputs(Case("z", 4, 0, 200, 99), 6, snapped=False)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    for split in (1, 2):
        out = poisoned((4, 99), torch.bfloat16, device)
        linear_fp8(x.to(device), w.to(device), s.to(device), zero, out=out,
                   config=LinearLaunch(32, split))
        assert_live_written_pad_untouched(out, 0, f"n_live = 0, split {split}")
    out = poisoned((4, 99), torch.float32, device)
    linear_bf16_f32(x.bfloat16().to(device), w.float().bfloat16().to(device), zero, out=out)
    assert_live_written_pad_untouched(out, 0, "linear_bf16_f32, n_live = 0")


def act_quant_per_row(x: torch.Tensor) -> torch.Tensor:
    """Mutant act-quant: one scale per row instead of per 128 columns (dequantized, FP32)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 448.0
    return (xf / scale).clamp(-448, 448).to(E4M3).float() * scale


def act_quant_pow2(x: torch.Tensor) -> torch.Tensor:
    """Mutant act-quant: power-of-two scales (rounded up), per row per 128 columns."""
    q, sc = ops.quantize_act(x.float())
    sc2 = torch.exp2(torch.ceil(torch.log2(sc)))
    full = sc2.repeat_interleave(128, dim=1)[:, : x.shape[1]]
    return (x.float() / full).clamp(-448, 448).to(E4M3).float() * full


def fp8_mutants(case: Case, snapped: bool, device) -> dict[str, str]:
    """Broken variants of linear_fp8 on one input kind; each must fail that kind's row."""
    x, w, s, n = inputs(case, 31, snapped)
    xd, wd, sd, nd = x.to(device), w.to(device), s.to(device), n.to(device)
    row = "kernels.linear_fp8.snapped" if snapped else "kernels.linear_fp8"
    tag = "snapped" if snapped else "random"
    twin = linear_fp8_ref(x, w, s, n, out_dtype=torch.float32)

    def kernel(scales):
        return linear_fp8(xd, wd, scales, nd, out_dtype=torch.float32,
                          config=case.config).cpu()[:6]

    def fails_row(got, want=twin) -> str:
        return fails(lambda: check(got, want, row, "fp32"))

    y = kernel(sd)
    check(y, twin, row, "fp32")
    out = {}
    shifted = sd.clone()
    shifted[0, 1] = sd[0, 2]  # one block reads its neighbour's scale
    out[f"scale block shifted ({tag})"] = fails_row(kernel(shifted))
    per_n = sd[:, :1].expand_as(sd).contiguous()  # scale per 128-N only, K block ignored
    out[f"scale per 128-N, not per K block ({tag})"] = fails_row(kernel(per_n))
    part = linear_fp8_partials(xd, wd, sd, nd, config=case.config).cpu()[:, :6]
    check(reduce_splits_ref(part, torch.float32), twin, row, "fp32")
    out[f"split-K partial dropped ({tag})"] = fails_row(
        reduce_splits_ref(part[[0, 2]], torch.float32))
    if not snapped:  # snapped groups have power-of-two scales 2× apart: both are lossless there
        wdq = ops.dequant_block(w, s)
        out["act scale per row"] = fails_row(act_quant_per_row(x[:6]) @ wdq.t(), y)
        out["power-of-two act scales"] = fails_row(act_quant_pow2(x[:6]) @ wdq.t(), y)
    return out


def shifted_bf16(case: Case, device) -> torch.Tensor:
    x, w, s, n = inputs(case, 32, snapped=False)
    bad = s.roll(1, dims=1)  # the whole scale grid shifted by one K block
    return linear_fp8(x.to(device), w.to(device), bad.to(device), n.to(device),
                      config=case.config).cpu()[:6]


@pytest.mark.slow
def test_broken_variants_exceed_their_rows(device):
    """Each linear_fp8 tolerance row is shown to fail for the broken variants it names."""
    case = Case("mutants", 8, 6, 384, 160, LinearLaunch(32, 3))
    out = {**fp8_mutants(case, True, device), **fp8_mutants(case, False, device)}
    x, w, s, n = inputs(case, 32, snapped=False)
    got = linear_fp8(x.to(device), w.to(device), s.to(device), n.to(device),
                     out_dtype=torch.float32, config=case.config).cpu()[:6]
    truncated = (got.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    got_bf16 = linear_fp8(x.to(device), w.to(device), s.to(device), n.to(device),
                          config=case.config).cpu()[:6]
    out["bf16 output by truncation"] = fails(
        lambda: check(bits(got_bf16), bits(truncated), "kernels.linear.bit_exact", "bf16"))
    out["scale grid shifted by one K block (bf16 out)"] = fails(lambda: check(
        shifted_bf16(case, device), linear_fp8_ref(x, w, s, n), "kernels.linear_fp8", "bf16"))
    for key, val in out.items():
        print(f"\n  broken: {key}: {val}")


# --- BF16 (lm_head, eh_proj) ---------------------------------------------------------------------


BF16_CASES = (
    Case("r1-k128-n64", 1, 1, 128, 64, LinearLaunch(64, 1)),
    Case("r3-k200-n99-s2", 3, 3, 200, 99, LinearLaunch(32, 2)),
    Case("r8of5-k200-n99", 8, 5, 200, 99, LinearLaunch(32, 1, 64)),
    Case("r8of6-k128-n512-strided", 8, 6, 128, 512, None, strided=True),  # tiny lm_head
)


def bf16_operands(case: Case, seed: int, snapped: bool):
    gen = torch.Generator().manual_seed(seed)
    if snapped:  # integers ≤ 16 × 2^-4 / 2^-6: every FP32 partial sum is exact
        x = torch.randint(-16, 17, (case.rows, case.k), generator=gen) * 2.0**-4
        w = torch.randint(-16, 17, (case.n, case.k), generator=gen) * 2.0**-6
    else:
        x = torch.randn(case.rows, case.k, generator=gen) * 3
        w = torch.randn(case.n, case.k, generator=gen) * 0.02
    return with_garbage(x, case.n_live, torch.bfloat16), w.bfloat16()


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("snapped", [True, False], ids=["snapped", "random"])
def test_linear_bf16_matches_twin(case, snapped, device):
    x, w = bf16_operands(case, 40 + BF16_CASES.index(case), snapped)
    n = torch.tensor([case.n_live], dtype=torch.int32)
    xd, wd = place(x, device, case.strided), place(w, device, case.strided)
    live, outs = case.n_live, {}
    for dtype in (torch.float32, torch.bfloat16):
        out = linear_bf16_f32(xd, wd, n.to(device), out_dtype=dtype, config=case.config,
                              out=poisoned((case.rows, case.n), dtype, device))
        assert_live_written_pad_untouched(out, live, f"linear_bf16 out ({dtype})")
        twin = linear_bf16_f32_ref(x, w, n, out_dtype=dtype)
        if snapped:
            if dtype == torch.float32:  # the claim that makes the exact row meaningful
                assert torch.equal(twin.double(), x[:live].double() @ w.double().t())
            m = check(out.cpu()[:live], twin, "kernels.linear_bf16_f32.snapped", "fp32")
        elif dtype == torch.float32:
            m = check(out.cpu()[:live], twin, "kernels.linear_bf16_f32", "fp32")
        else:
            m = check(out.cpu()[:live], twin, "kernels.linear_fp8", "bf16")  # same mechanism
            ulps = grid_steps(out.cpu()[:live], twin, "bf16")
            m = f"{m}; {int((ulps > 0).sum())} of {ulps.numel()} bf16 elements differ"
        outs[dtype] = out.cpu()[:live]
        print(f"\n  [{case.name}] {dtype}: {m}")
    check(bits(outs[torch.bfloat16]), bits(outs[torch.float32].bfloat16()),
          "kernels.linear.bit_exact", "bf16")


def test_linear_bf16_broken_variants(device):
    case = Case("mutants", 8, 6, 200, 99, LinearLaunch(32, 2))
    x, w = bf16_operands(case, 51, snapped=False)
    n = torch.tensor([6], dtype=torch.int32)
    twin = linear_bf16_f32_ref(x, w, n)
    got = linear_bf16_f32(x.to(device), w.to(device), n.to(device), config=case.config).cpu()[:6]
    check(got, twin, "kernels.linear_bf16_f32", "fp32")
    out = {"logits rounded to bf16": fails(lambda: check(
        got.bfloat16().float(), twin, "kernels.linear_bf16_f32", "fp32"))}
    cut = x.clone()
    cut[:, 128:] = 0  # the last, partial 128-column block dropped
    dropped = linear_bf16_f32(cut.to(device), w.to(device), n.to(device), config=case.config)
    out["partial last K block dropped"] = fails(lambda: check(
        dropped.cpu()[:6], twin, "kernels.linear_bf16_f32", "fp32"))
    for key, val in out.items():
        print(f"\n  broken: {key}: {val}")


# --- launch plan, wrapper errors ---------------------------------------------------------------


def test_split_plan_covers_every_block_once():
    for k_blocks in range(1, 40):
        for want in range(1, 50):
            s, kb = split_plan(k_blocks, want)
            covered = [b for j in range(s) for b in range(j * kb, min((j + 1) * kb, k_blocks))]
            assert covered == list(range(k_blocks)), (k_blocks, want)
            assert (s - 1) * kb < k_blocks, "an empty split"
            assert s <= min(want, k_blocks)
    # per-rank shapes: enough programs to stream with every SM (132), split S as pinned
    for (n, k), splits in (((1024, 3072), 8), ((3072, 768), 3), ((1536, 3072), 6),
                           ((3072, 1536), 3), ((3072, 3072), 3)):
        cfg = linear_fp8_launch(n, k)
        assert linear_fp8_splits(n, k) == splits
        assert -(-n // cfg.block_n) * splits >= 128


def test_wrapper_errors(device):
    x = torch.randn(4, 200, device=device).bfloat16()
    w, s = ops.quantize_block(torch.randn(99, 200))
    w, s = w.to(device), s.to(device)
    with pytest.raises(ValueError, match="x: expected 2 dims"):
        linear_fp8(x[0], w, s)
    with pytest.raises(ValueError, match=r"x: expected 1..16 rows"):
        linear_fp8(x.repeat(5, 1), w, s)
    with pytest.raises(ValueError, match="weight: expected 200 columns"):
        linear_fp8(x, w[:, :128], s)
    with pytest.raises(ValueError, match="weight: expected dtype"):
        linear_fp8(x, w.float(), s)
    with pytest.raises(ValueError, match=r"scale_inv: expected shape \(1, 2\)"):
        linear_fp8(x, w, s[:1, :1])
    with pytest.raises(ValueError, match="n_live: expected dtype"):
        linear_fp8(x, w, s, torch.tensor([2], device=device))
    with pytest.raises(ValueError, match="out_dtype"):
        linear_fp8(x, w, s, out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"out: expected shape \(4, 99\)"):
        linear_fp8(x, w, s, out=torch.empty(4, 98, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match=r"partials: expected shape \(2, 4, 99\)"):
        linear_fp8(x, w, s, config=LinearLaunch(32, 2),
                   partials=torch.empty(3, 4, 99, device=device))
    with pytest.raises(ValueError, match="config.block_k"):
        linear_fp8(x, w, s, config=LinearLaunch(32, 1, 64))
    with pytest.raises(ValueError, match="LinearLaunch.block_n"):
        LinearLaunch(48, 1)
    with pytest.raises(ValueError, match="LinearLaunch.split_k"):
        LinearLaunch(32, 0)
    with pytest.raises(ValueError, match="x: expected dtype"):
        linear_bf16_f32(x.float(), w.float())
    with pytest.raises(ValueError, match="weight: expected dtype"):
        linear_bf16_f32(x, w)


def test_rows_are_in_the_table():
    for op, dtype in (("kernels.linear_fp8", "fp32"), ("kernels.linear_fp8", "bf16"),
                      ("kernels.linear_bf16_f32", "fp32")):
        assert not tolerance(op, dtype).exact
    for op, dtype in (("kernels.linear_fp8.snapped", "fp32"),
                      ("kernels.linear_bf16_f32.snapped", "fp32"),
                      ("kernels.linear.bit_exact", "bf16"), ("kernels.linear.bit_exact", "fp32")):
        assert tolerance(op, dtype).exact


# --- compiled for sm_90 without a GPU ------------------------------------------------------------

SM90_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import linear
from tests.kernels.sass import disassemble, round_trips_before_tiles

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

def build(fn, sig, const, **opts):
    full = {a: "constexpr" if a in const else sig.get(a, "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a not in const and (full[a].startswith("*") or a.startswith("stride"))}
    k = triton.compile(ASTSource(fn, full, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    v = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                       capture_output=True, text=True).stderr
    os.unlink(f.name)
    got = {t: len(re.findall(t, ptx)) for t in ("wgmma", r"cp\.async", r"div\.rn\.f32",
                                                 r"div\.full", r"div\.approx")}
    got["spill"] = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", v))
    got["shared"] = k.metadata.shared
    inside, got["loop_loads"] = False, 0  # synchronous loads between scf.for and scf.yield
    for line in k.asm["ttgir"].splitlines():
        inside = (inside or "scf.for" in line) and "scf.yield" not in line
        got["loop_loads"] += inside and " tt.load " in line
    # global-load round trips before the first cp.async tile load (ptxas's SASS)
    if got[r"cp\.async"]:
        got["trips"] = round_trips_before_tiles(disassemble(k.asm["cubin"]))
    wait, pre = ptx.find("griddepcontrol.wait"), ptx.find("prefetch.global.L2::evict_last")
    got["prefetches"] = ptx.count("prefetch.global.L2::evict_last")
    got["prefetch_before_wait"] = int(0 <= pre < wait)
    return got

u = dict(stride_wk=1, stride_on=1)
fp8 = dict(xq_ptr="*fp8e4nv", sx_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32",
           n_live_ptr="*i32", out_ptr="*fp32")
res = {}
for name, (n, k, out, hoist, early) in {"qkv_partials": (1024, 3072, "*fp32", False, False),
                                        "o_bf16": (3072, 768, "*bf16", False, False),
                                        "qkv_hoist": (1024, 3072, "*fp32", True, False),
                                        "qkv_early": (1024, 3072, "*fp32", False, True),
                                        "o_early": (3072, 768, "*bf16", True, True),
                                        "qkv_prefetch": (1024, 3072, "*fp32", False, False)
                                        }.items():
    cfg = linear.linear_fp8_launch(n, k)
    s, kb = linear.split_plan(-(-k // 128), cfg.split_k)
    res[name] = build(linear._linear_fp8_kernel, dict(fp8, out_ptr=out),
                      dict(u, K=k, KB=kb, BLOCK_N=cfg.block_n, BLOCK_R=16,
                           OUT_BF16=out == "*bf16", HOIST=hoist, EARLY=early,
                           PREFETCH=name == "qkv_prefetch", PDL=name == "qkv_prefetch"),
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
cfg = linear.linear_bf16_launch(20000, 3072)
res["lm_head"] = build(linear._linear_bf16_kernel,
                       dict(x_ptr="*bf16", w_ptr="*bf16", n_live_ptr="*i32", out_ptr="*fp32"),
                       dict(u, stride_xk=1, K=3072, KB=24, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                            BLOCK_R=16, OUT_BF16=False, INTERPRET=False, PDL=False),
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
res["reduce"] = build(linear._reduce_splits_kernel,
                      dict(p_ptr="*fp32", n_live_ptr="*i32", out_ptr="*bf16"),
                      dict(stride_on=1, S=8, BLOCK=1024, OUT_BF16=True, PDL=False), num_warps=4)
print(json.dumps(res))
"""


@pytest.mark.slow
def test_linear_kernels_compile_for_sm90():
    """Without a GPU: compile the production variants for sm_90 with Triton's ptxas. The GEMMs
    must use wgmma with cp.async-pipelined weight loads (the memory-bound part) and no register
    spills; the FP8 GEMM receives x already quantized, so it has no division at all (the
    act-quant kernel's IEEE div.rn.f32 is checked in test_fp8.py)."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its NVIDIA backend")
    got = compile_sm90(SM90_COMPILE)
    print(f"\n  sm_90: {got}")
    for name in ("qkv_partials", "o_bf16", "lm_head"):
        assert got[name]["wgmma"] > 0 and got[name]["cp\\.async"] > 0, name
    for name, g in got.items():
        assert g["spill"] == 0, f"{name}: {g['spill']} bytes of register spills"
    for name in ("qkv_partials", "o_bf16"):
        g = got[name]
        assert g["div\\.rn\\.f32"] == g["div\\.full"] == g["div\\.approx"] == 0, name
    # hoisted scales: the pipelined K loop waits on the cp.async tiles only, where the loop it
    # replaces loads both scales synchronously after each wait
    assert got["qkv_partials"]["loop_loads"] >= 2 and got["qkv_hoist"]["loop_loads"] == 0
    assert got["qkv_hoist"]["wgmma"] > 0 and got["qkv_hoist"]["cp\\.async"] > 0
    # early loads: the first tile load goes out before n_live comes back, where the pinned
    # launch waits for it first (its rows mask every x load)
    assert got["qkv_partials"]["trips"] == got["o_bf16"]["trips"] == 1
    assert got["qkv_early"]["trips"] == got["o_early"]["trips"] == 0
    assert got["o_early"]["loop_loads"] == 0 and got["qkv_early"]["wgmma"] > 0
    # LinearLaunch.prefetch_w (with PDL): the program's weight slice (64 channels × 3 blocks)
    # prefetched into L2 before the PDL wait; no prefetch anywhere else
    pre = got["qkv_prefetch"]
    assert pre["prefetch_before_wait"] == 1 and pre["prefetches"] >= 1 and pre["trips"] == 1
    assert all(g["prefetches"] == 0 for name, g in got.items() if name != "qkv_prefetch")


# --- GPU only: per-rank TP8 shapes, CUDA graphs, no host sync ------------------------------------

RANK_FP8 = (("qkv", 1024, 3072), ("o", 3072, 768), ("gate", 1536, 3072),
            ("gate_up", 3072, 3072), ("down", 3072, 1536))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", RANK_FP8, ids=lambda s: s[0])
@pytest.mark.parametrize("n_live", [1, 6, 8])
@pytest.mark.parametrize("snapped", [True, False], ids=["snapped", "random"])
def test_linear_fp8_rank_shapes(shape, n_live, snapped, device):
    _, n, k = shape
    report = run_fp8(Case(f"{shape[0]}-{n_live}of8", 8, n_live, k, n), 300 + n_live, snapped,
                     device)
    for key, val in report.items():
        print(f"\n  [{shape[0]} n={n_live}] {key}: {val}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", RANK_FP8, ids=lambda s: s[0])
def test_hoisted_scales_rank_shapes(shape, device):
    """LinearLaunch.hoist_scales and early_loads at the pinned rank launches (compiled, wgmma)
    == the pinned loads, bit for bit, partials and bf16 output, 1 / 6 / 8 live rows."""
    _, n, k = shape
    for n_live in (1, 6, 8):
        case = Case(f"{shape[0]}-{n_live}of8", 8, n_live, k, n)
        x, w, s, nl = (t.to(device) for t in inputs(case, 320 + n_live, snapped=False))
        got = []
        for cfg in (linear_fp8_launch(n, k), *(hoisted(None, n, k, **m) for m in MOVED)):
            got.append((bits(linear_fp8_partials(x, w, s, nl, config=cfg)[:, :n_live]),
                        bits(linear_fp8(x, w, s, nl, config=cfg)[:n_live])))
        for moved, other in zip(MOVED, got[1:], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got[0], other, strict=True)), \
                (case.name, moved)


@pytest.mark.gpu
@pytest.mark.parametrize("n_live", [1, 8])
def test_lm_head_rank_shape(n_live, device):
    case = Case("lm_head", 8, n_live, 3072, 20000)
    for snapped in (True, False):
        x, w = bf16_operands(case, 400 + n_live, snapped)
        n = torch.tensor([n_live], dtype=torch.int32)
        out = linear_bf16_f32(x.to(device), w.to(device), n.to(device),
                              out=poisoned((8, 20000), torch.float32, device))
        assert_live_written_pad_untouched(out, n_live, "lm_head")
        row = "kernels.linear_bf16_f32.snapped" if snapped else "kernels.linear_bf16_f32"
        print(f"\n  [lm_head n={n_live} snapped={snapped}] "
              f"{check(out.cpu()[:n_live], linear_bf16_f32_ref(x, w, n), row, 'fp32')}")


@pytest.mark.gpu
def test_cuda_graph_and_no_host_sync(device):
    case = Case("qkv-graph", 8, 8, 3072, 1024)
    x, w, s, _ = inputs(case, 77, snapped=False)
    xd, wd, sd = x.to(device), w.to(device), s.to(device)
    n = torch.tensor([8], dtype=torch.int32, device=device)
    out = poisoned((8, 1024), torch.bfloat16, device)
    part = torch.empty(linear_fp8_splits(1024, 3072), 8, 1024, device=device)
    linear_fp8(xd, wd, sd, n, out=out, partials=part)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        linear_fp8(xd, wd, sd, n, out=out, partials=part)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        linear_fp8(xd, wd, sd, n, out=out, partials=part)
    for live in (3, 8, 1):
        out.copy_(poisoned((8, 1024), torch.bfloat16, device))
        n.fill_(live)
        graph.replay()
        torch.cuda.synchronize()
        assert_live_written_pad_untouched(out, live, f"graph replay n={live}")
        twin = linear_fp8_ref(x, w, s, torch.tensor([live]))
        check(out.cpu()[:live], twin, "kernels.linear_fp8", "bf16")


@pytest.mark.gpu
def test_bench_linear_qkv(benchmark):
    """QKV per rank, 6 live rows, 32 weight copies (100 MB ≫ L2) cycled in one CUDA graph of 32
    calls. Divide the reported time by 32 for one call."""
    from benchmarks.bench_linear import SHAPES, build_problem, capture_graph

    problem = build_problem(dict(SHAPES)["qkv"], rows=6, copies=32, device=torch.device("cuda"))
    graph = capture_graph(problem.kernel_calls(), reps=32)

    def step():
        graph.replay()
        torch.cuda.synchronize()

    benchmark(step)
