"""kernels/fp8.py against its twins (reference/twins/fp8.py): activation quantization and block
dequantization must be bit-exact (rows 'kernels.fp8.*' of qualification/tolerances.py).

Dimension letters: R rows, C columns, E experts, N weight rows, K weight columns.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import E4M3, dequant_block, quantize_act
from qualification.tolerances import check, tolerance
from reference import ops
from reference.twins.fp8 import dequant_block_ref, quantize_act_ref
from tests.kernels.sm90 import compile_sm90

E4M3_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3)  # all 256 codes
FINITE_E4M3 = E4M3_CODES[~torch.isnan(E4M3_CODES.float())].float().unique()  # [253] sorted


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32)


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor, op: str, dtype: str) -> None:
    got, want = got.cpu(), want.cpu()
    assert torch.equal(bits(got), bits(want)), f"{op}: not bit-exact"
    check(got.float(), want.float(), op, dtype)  # also runs the table's exact row


def tie_heavy(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """[R, C] fp32 whose x/scale lands exactly on E4M3 midpoints, zeros, subnormals and ±448.

    Each row group keeps amax = 448·2^p (scale 2^p exactly), so x/scale is the drawn value and
    RNE decides ties: midpoints between neighbours (incl. 15.5 → 16, a carry into the exponent),
    subnormal midpoints (2^-10, 3·2^-10) and values below half the smallest subnormal.
    """
    mids = (FINITE_E4M3[1:] + FINITE_E4M3[:-1]) / 2
    pool = torch.cat([FINITE_E4M3, mids, torch.tensor([2.0**-10, 3 * 2.0**-10, 2.0**-12, 0.0])])
    pool = pool[pool.abs() <= 448]
    v = pool[torch.randint(len(pool), (rows, cols), generator=gen)]
    v = v * (torch.randint(2, (rows, cols), generator=gen) * 2 - 1)
    v[:, ::128] = 448.0  # amax of every group
    p = torch.randint(-6, 3, (rows, -(-cols // 128)), generator=gen).float()
    return v * torch.exp2(p).repeat_interleave(128, dim=1)[:, :cols]


@pytest.mark.parametrize(
    "rows,cols,dtype",
    [(1, 128, torch.float32), (3, 160, torch.bfloat16), (5, 200, torch.float32),
     (8, 384, torch.float16), (2, 19, torch.float32)],
)
def test_quantize_act_bit_exact_random(rows, cols, dtype, device):
    gen = torch.Generator().manual_seed(1000 + rows * 1000 + cols)
    x = (torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-12, 8, (rows, 1),
                                                                         generator=gen).float()))
    if rows > 1:
        x[-1, : min(cols, 128)] = 0.0  # an all-zero group: scale 1
        x[0, 3] = -0.0
    x = x.to(dtype)
    q, s = quantize_act(x.to(device))
    q_ref, s_ref = quantize_act_ref(x)
    assert_bit_exact(q, q_ref, "kernels.fp8.quantize_act", "e4m3")
    assert_bit_exact(s, s_ref, "kernels.fp8.quantize_act", "e4m3")


def test_quantize_act_ties_and_subnormals(device):
    gen = torch.Generator().manual_seed(7)
    x = tie_heavy(4, 384, gen)
    q, s = quantize_act(x.to(device))
    q_ref, s_ref = quantize_act_ref(x)
    assert_bit_exact(q, q_ref, "kernels.fp8.quantize_act", "e4m3")
    assert_bit_exact(s, s_ref, "kernels.fp8.quantize_act", "e4m3")
    # The data really exercises ties: a round-half-away-from-zero cast must differ (negative
    # control for the exact row; it is what the Triton interpreter's own fp32→E4M3 cast does).
    y = (x / s_ref.repeat_interleave(128, dim=1)[:, : x.shape[1]]).clamp(-448, 448)
    lo = FINITE_E4M3[torch.searchsorted(FINITE_E4M3, y.abs(), right=True) - 1]
    hi = FINITE_E4M3[torch.searchsorted(FINITE_E4M3, y.abs()).clamp(max=len(FINITE_E4M3) - 1)]
    away = torch.where(y.abs() - lo >= hi - y.abs(), hi, lo) * y.sign()
    assert not torch.equal(bits(away.to(E4M3)), bits(q_ref)), "ties absent: control is vacuous"
    with pytest.raises(AssertionError):
        assert_bit_exact(away.to(E4M3), q.cpu(), "kernels.fp8.quantize_act", "e4m3")


def division_sensitive(rows: int, gen: torch.Generator) -> torch.Tensor:
    """[R, 128] fp32 where x / scale (IEEE) and x · (448 / amax) round to different E4M3 codes.

    Per row: amax A in [1, 2) so scale = A/448 is not a power of two; the other elements are
    E4M3 midpoints times the scale, nudged by a few fp32 ulps, kept where the two formulas
    disagree (an approximate or reciprocal division flips exactly these).
    """
    mids = (FINITE_E4M3[1:] + FINITE_E4M3[:-1]) / 2
    mids = mids[(mids > 0) & (mids < 448)]
    out = torch.zeros(rows, 128)
    nudge = 1.0 + torch.arange(-4, 5).float() * 2.0**-23
    for r in range(rows):
        picked = torch.zeros(0)
        while len(picked) < 32:  # some amax values give few disagreements; draw another
            a = 1.0 + torch.rand(1, generator=gen)
            scale = a / 448.0
            x = (mids[:, None] * scale * nudge[None, :]).reshape(-1)
            div = (x / scale).clamp(-448, 448).to(E4M3)
            rec = (x * (448.0 / a)).clamp(-448, 448).to(E4M3)
            picked = x[bits(div) != bits(rec)]
        idx = torch.randint(len(picked), (127,), generator=gen)
        out[r, 1:] = picked[idx] * torch.where(torch.rand(127, generator=gen) < 0.5, -1.0, 1.0)
        out[r, 0] = a
    return out


def test_quantize_act_division_is_ieee(device):
    """Multiplying by 448/amax instead of dividing by amax/448 (or an approximate `/`) is a
    plausible bug; on division-sensitive data the kernel must still match and the control fail."""
    gen = torch.Generator().manual_seed(11)
    x = division_sensitive(4, gen)
    q, s = quantize_act(x.to(device))
    q_ref, s_ref = quantize_act_ref(x)
    assert_bit_exact(q, q_ref, "kernels.fp8.quantize_act", "e4m3")
    assert_bit_exact(s, s_ref, "kernels.fp8.quantize_act", "e4m3")
    amax = x.abs().amax(-1, keepdim=True)
    broken = (x * (448.0 / amax)).clamp(-448, 448).to(E4M3)
    n_diff = int((bits(broken) != bits(q_ref)).sum())
    assert n_diff > 100, f"control differs in only {n_diff} codes"
    with pytest.raises(AssertionError):
        assert_bit_exact(broken, q.cpu(), "kernels.fp8.quantize_act", "e4m3")


def test_quantize_act_live_rows_only(device):
    """Rows ≥ n_live are never read (NaN/huge garbage) nor written (poisoned outputs stay)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 200, generator=gen)
    x[5:] = float("nan")
    x[6, 7] = 3e38
    q_out = torch.full((8, 200), 0x7F, dtype=torch.uint8).view(E4M3)  # NaN code
    s_out = torch.full((8, 2), float("nan"))
    n = torch.tensor([5], dtype=torch.int32, device=device)
    q, s = quantize_act(x.to(device), n, q_out=q_out.to(device), scale_out=s_out.to(device))
    q_ref, s_ref = quantize_act_ref(x, n.cpu())
    assert_bit_exact(q[:5], q_ref, "kernels.fp8.quantize_act", "e4m3")
    assert_bit_exact(s[:5], s_ref, "kernels.fp8.quantize_act", "e4m3")
    assert torch.equal(bits(q[5:].cpu()), bits(q_out[5:])), "padding rows of q were written"
    assert torch.isnan(s[5:]).all(), "padding rows of scales were written"


def test_quantize_act_noncontiguous(device):
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(300, 6, generator=gen)
    x = base.t()[:, 50:250]  # [6, 200] with column stride 6
    assert not x.is_contiguous()
    q, s = quantize_act(x.to(device) if device.type == "cpu" else base.to(device).t()[:, 50:250])
    q_ref, s_ref = quantize_act_ref(x)
    assert_bit_exact(q, q_ref, "kernels.fp8.quantize_act", "e4m3")
    assert_bit_exact(s, s_ref, "kernels.fp8.quantize_act", "e4m3")


@pytest.mark.parametrize("shape", [(2, 128, 128), (3, 200, 300), (1, 384, 160), (19, 99)])
def test_dequant_block_bit_exact(shape, device):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=gen) * 3
    q, s = ops.quantize_block(w)
    s = s * torch.exp2(torch.randn(s.shape, generator=gen))  # non-power-of-two scales
    got = dequant_block(q.to(device), s.to(device))
    want = dequant_block_ref(q, s)
    assert_bit_exact(got, want, "kernels.fp8.dequant_block", "fp32")
    # negative control: the partial edge block reading its neighbour's scale must fail
    if s.shape[-1] > 1 and shape[-1] % 128:
        s_bad = s.clone()
        s_bad[..., -1] = s[..., -2]
        with pytest.raises(AssertionError):
            assert_bit_exact(got, dequant_block_ref(q, s_bad), "kernels.fp8.dequant_block", "fp32")


def test_dequant_all_codes(device):
    """Every E4M3 code (subnormals, ±0, NaN) times a non-trivial scale."""
    q = E4M3_CODES.reshape(2, 128)
    s = torch.tensor([[0.3]])
    got = dequant_block(q.to(device), s.to(device)).cpu()
    want = dequant_block_ref(q, s)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(bits(got[~nan]), bits(want[~nan]))


SM90_COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import fp8

def build(fn, sig, const):
    full = {n: "constexpr" if n in const else sig.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, full, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    ptx = k.asm["ptx"]
    return {t: len(re.findall(t, ptx)) for t in ("div.rn.f32", "div.full", "div.approx", "e4m3x2")}

cfg = fp8.act_quant_launch(3072)
print(json.dumps({
    "act_quant": build(fp8._act_quant_kernel,
                       dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", n_live_ptr="*i32"),
                       dict(ROWS_PER_LIVE=1, GROUPS=cfg.groups, PDL=False)),
    "dequant": build(fp8._dequant_block_kernel,
                     dict(w_ptr="*fp8e4nv", s_ptr="*fp32", out_ptr="*fp32"),
                     dict(BLOCK_N=64, BLOCK_K=128, PDL=False)),
}))
"""


@pytest.mark.slow
def test_fp8_kernels_compile_for_sm90():
    """Without a GPU: compile for sm_90 with Triton's ptxas; the act-quant divisions must be the
    IEEE-rounded div.rn.f32 (not div.full/div.approx) and the E4M3 cast a hardware cvt."""
    got = compile_sm90(SM90_COMPILE)
    print(f"\n  sm_90 PTX: {got}")
    aq = got["act_quant"]
    assert aq["div.rn.f32"] > 0 and aq["div.full"] == 0 and aq["div.approx"] == 0
    assert aq["e4m3x2"] > 0 and got["dequant"]["e4m3x2"] > 0


def test_exact_rows_are_exact():
    assert tolerance("kernels.fp8.quantize_act", "e4m3").exact
    assert tolerance("kernels.fp8.dequant_block", "fp32").exact


def test_wrapper_errors(device):
    x = torch.randn(4, 128, device=device)
    with pytest.raises(ValueError, match="x: expected 2 dims"):
        quantize_act(x[0])
    with pytest.raises(ValueError, match="x: expected dtype"):
        quantize_act(x.to(torch.int32))
    with pytest.raises(ValueError, match="n_live: expected dtype"):
        quantize_act(x, torch.tensor([2], device=device))
    with pytest.raises(ValueError, match="n_live: expected one element"):
        quantize_act(x, torch.tensor([2, 3], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"q_out: expected shape \(4, 128\)"):
        quantize_act(x, q_out=torch.empty(4, 64, dtype=E4M3, device=device))
    q, s = ops.quantize_block(torch.randn(2, 200, 130))
    with pytest.raises(ValueError, match=r"scale_inv: expected shape \(2, 2, 2\)"):
        dequant_block(q.to(device), s[:, :1].to(device))
    with pytest.raises(ValueError, match="w: expected dtype"):
        dequant_block(q.float().to(device), s.to(device))
