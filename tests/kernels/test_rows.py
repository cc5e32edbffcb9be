"""kernels/rows.py against the twins' row-by-row torch expressions (iquestrt/ops.py TwinOps),
under the interpreter on CPU and compiled on a GPU: odd hidden sizes, poisoned outputs, NaN
garbage in padding rows (never read: live rows stay finite; never written: padding outputs stay
poisoned), and broken variants that must exceed each row of qualification/tolerances.py."""

from __future__ import annotations

import pytest
import torch

from iquestrt.ops import Live, TwinOps
from kernels.rows import norm_rows, route_rows, silu_mul_rows
from qualification.tolerances import check, measure, tolerance
from reference import ops as ref_ops
from tests.kernels.sm90 import fusion_counts

EPS = 1e-6
R = 8


def _inputs(seed: int, rows: int, hidden: int, n: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 2).to(dtype)
    x[n:] = float("nan")  # padding garbage
    return x, g


def _twins() -> TwinOps:
    return TwinOps(torch.device("cpu"), 1)


@pytest.mark.parametrize("hidden", [128, 200])
@pytest.mark.parametrize("n", [1, 5, 8])
def test_norm_rows_matches_twin(hidden, n, device):
    a, g = _inputs(hidden + n, R, hidden, n)
    b, _ = _inputs(hidden + n + 1, R, hidden, n)
    a32 = a.float()
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16()
    wb = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16()
    live = torch.tensor([n], dtype=torch.int32, device=device)
    cases = [  # (a, kwargs): rms of one tensor; layer 0's tail; the draft's FP32 residual
        (a, {}),
        (a, dict(b=b, wb=wb, sum_dtype=torch.bfloat16, store_sum=True)),
        (a, dict(b=b, wb=wb, store_sum=True)),
        (a32, dict(b=b, wb=wb)),
    ]
    for aa, kw in cases:
        kwd = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        s, y = norm_rows(aa.to(device), w.to(device), live, EPS, **kwd)
        ts, ty = _twins().norm_rows(aa, w, Live.of(n, "cpu"), EPS, **kw)
        for got, want in ((s, ts), (y, ty)):
            if got is None:
                assert want is None
                continue
            got = got.cpu()
            dt = "bf16" if got.dtype == torch.bfloat16 else "fp32"
            check(got[:n], want[:n], "kernels.rows.norm", dt)
            assert torch.isfinite(got[:n].float()).all()


def test_norm_rows_writes_only_live_rows_and_strided_outputs(device):
    n, hidden = 3, 128
    a, g = _inputs(5, R, hidden, n)
    w = torch.ones(hidden).bfloat16()
    eh = torch.full((R, 2 * hidden), -7.0, dtype=torch.bfloat16, device=device)
    live = torch.tensor([n], dtype=torch.int32, device=device)
    norm_rows(a.to(device), w.to(device), live, EPS, y_out=eh[:, hidden:])
    eh = eh.cpu()
    assert (eh[:, :hidden] == -7).all() and (eh[n:] == -7).all()
    want = ref_ops.rms_norm(a[:n], w, EPS)
    check(eh[:n, hidden:], want, "kernels.rows.norm", "bf16")


def test_silu_mul_rows_matches_twin(device):
    n, F = 6, 384
    gt, gen = _inputs(11, R, F, n)
    ut, _ = _inputs(12, R, F, n)
    live = torch.tensor([n], dtype=torch.int32, device=device)
    got = silu_mul_rows(gt.to(device), ut.to(device), live).cpu()
    want = _twins().silu_mul_rows(gt, ut, Live.of(n, "cpu"))
    check(got[:n], want[:n], "kernels.rows.silu", "bf16")


@pytest.mark.parametrize("experts,top_k", [(16, 4), (24, 4), (256, 8)])
def test_route_rows_matches_twin(experts, top_k, device):
    n, hidden = 5, 128
    x, g = _inputs(experts, R, hidden, n)
    rw = torch.randn(experts, hidden, generator=g) / hidden**0.5
    live = torch.tensor([n], dtype=torch.int32, device=device)
    wts, ids = route_rows(x.to(device), rw.to(device), top_k, live)
    tw, ti = _twins().route_rows(x, rw, top_k, Live.of(n, "cpu"))
    check(ids.cpu()[:n], ti[:n], "kernels.rows.route", "int32")
    check(wts.cpu()[:n], tw[:n], "kernels.rows.route", "fp32")
    assert (ids.cpu()[n:] == -1).all() and wts.cpu()[n:].isnan().all()


def test_broken_variants_exceed_their_rows():
    """The mutants named by the rows: each moves the result outside its tolerance."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 256, generator=g).bfloat16()
    b = (torch.randn(4, 256, generator=g) * 3).bfloat16()
    w = (1 + 0.2 * torch.randn(256, generator=g)).bfloat16()
    good = (a.float() + ref_ops.rms_norm(b, w, EPS).float())  # inner rms rounded to bf16
    unrounded = a.float() + ref_ops.rms_norm(b.float(), w, EPS)
    assert not measure(unrounded, good, tolerance("kernels.rows.norm", "fp32")).ok
    y = ref_ops.rms_norm(a, w, EPS)
    no_weight = ref_ops.rms_norm(a, torch.ones_like(w), EPS)
    assert not measure(no_weight, y, tolerance("kernels.rows.norm", "bf16")).ok
    u = torch.randn(4, 256, generator=g).bfloat16()
    silu = (torch.nn.functional.silu(a.float()) * u.float()).bfloat16()
    swapped = (torch.nn.functional.silu(u.float()) * a.float()).bfloat16()
    assert not measure(swapped, silu, tolerance("kernels.rows.silu", "bf16")).ok
    rw = torch.randn(16, 256, generator=g) / 16
    wts, ids = ref_ops.route(a, rw, 4)
    probs = torch.softmax(a.float() @ rw.t(), -1)
    unnorm = torch.gather(probs, 1, ids)
    assert not measure(unnorm, wts, tolerance("kernels.rows.route", "fp32")).ok
    with pytest.raises(AssertionError):
        check(ids.flip(1), ids, "kernels.rows.route", "int32")


SM90_NORM_ROWS = dict(
    module="rows", kernel="_norm_rows_kernel",
    sig=dict(a_ptr="*fp32", b_ptr="*bf16", wb_ptr="*bf16", w_ptr="*bf16", s_ptr="*fp32",
             y_ptr="*bf16", n_live_ptr="*i32", eps="fp32"),
    const=dict(HIDDEN=3072, BLOCK_H=4096, HAS_B=True, SUM_BF16=False, STORE_S=True, HAS_W=True,
               Y_BF16=True, B_BF16=True, PDL=False),
    patterns=(r"fma\.rn\.f32", r"div\.rn\.f32", r"sqrt\.rn\.f32", r"sqrt\.approx", r"rsqrt"))


@pytest.mark.slow
def test_norm_rows_compiles_for_sm90_without_fma():
    """As launched (enable_fp_fusion=False): no FMA contracts the residual add into the norm,
    IEEE div.rn / sqrt.rn; with fusion on, FMAs appear (so the check can fail)."""
    off, on = fusion_counts(**SM90_NORM_ROWS)
    got = {"False": off, "True": on}
    assert off["fma\\.rn\\.f32"] == 0 and on["fma\\.rn\\.f32"] > 0, got
    assert off["div\\.rn\\.f32"] >= 2 and off["sqrt\\.rn\\.f32"] >= 2, got
    assert off["sqrt\\.approx"] == off["rsqrt"] == 0, got


@pytest.mark.parametrize("experts,top_k", [(20, 4), (256, 8)])
@pytest.mark.slow
def test_route_rows_bits_do_not_depend_on_the_width_or_the_scratch(experts, top_k, device):
    """One program per expert block over all rows: a live row's ids and weights are the same
    bits with 5 exact rows, 8 padded rows (garbage beyond), a reused scratch or a fresh one; the
    arrival counter is back at 0 after each launch."""
    from kernels.router import RouteScratch

    n, hidden = 5, 256
    x, g = _inputs(experts + 7, R, hidden, n)
    rw = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(device)
    x = x.to(device)
    live = torch.tensor([n], dtype=torch.int32, device=device)
    scratch = RouteScratch.create(experts, device)
    padded = route_rows(x, rw, top_k, live, scratch=scratch)
    exact = route_rows(x[:n].contiguous(), rw, top_k, live, scratch=scratch)
    fresh = route_rows(x, rw, top_k, live)
    for other in (exact, fresh):
        assert torch.equal(other[1][:n], padded[1][:n])
        assert torch.equal(other[0][:n].view(torch.int32), padded[0][:n].view(torch.int32))
    assert scratch.counter.item() == 0 and scratch.flag.item() == 0
    assert (padded[1][n:] == -1).all() and padded[0][n:].isnan().all()


# the NaN row is the input under test; the interpreter's NumPy max over it warns
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_route_rows_a_non_finite_row_gets_no_expert(device):
    """A live row with a NaN input: ids −1, NaN weights and the scratch flag up; the other rows
    route as without it (an id out of range would send the experts' kernel out of bounds)."""
    from kernels.router import RouteScratch

    n, hidden, experts = 4, 128, 16
    x, g = _inputs(11, R, hidden, n)
    rw = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(device)
    live = torch.tensor([n], dtype=torch.int32, device=device)
    clean = route_rows(x.to(device), rw, 4, live)
    x[2, 7] = float("nan")
    scratch = RouteScratch.create(experts, device)
    wts, ids = route_rows(x.to(device), rw, 4, live, scratch=scratch)
    assert scratch.flag.item() == 1
    assert (ids[2] == -1).all() and wts[2].isnan().all()
    keep = [0, 1, 3]
    assert torch.equal(ids[keep], clean[1][keep]) and torch.equal(wts[keep], clean[0][keep])


def test_route_rows_refuses_more_rows_than_a_program_takes(device):
    x = torch.zeros(9, 128, dtype=torch.bfloat16, device=device)
    rw = torch.zeros(16, 128, device=device)
    with pytest.raises(ValueError, match="x has 9 rows, at most 8"):
        route_rows(x, rw, 4, torch.tensor([9], dtype=torch.int32, device=device))


SM90_ROUTE = dict(
    module="router", kernel="_route_kernel",
    sig={"x_ptr": "*bf16", "rw_ptr": "*fp32", "logit_ptr": "*fp32", "cnt_ptr": "*i32",
         "ids_ptr": "*i32", "wts_ptr": "*fp32", "flag_ptr": "*i32", "n_live_ptr": "*i32",
         "n_rows": "i32"},
    const={"HIDDEN": 3072, "EXPERTS": 256, "BLOCK_EALL": 256, "TOP_K": 8, "BLOCK_TOPK": 8,
           "ROUTE_ROWS": 8, "BLOCK_E": 2, "BLOCK_K": 1024, "PDL": False},
    patterns=("atom\\.acq_rel\\.gpu", "atom\\.global\\.gpu\\.acq_rel", "fma\\.rn\\.f32",
              "div\\.rn\\.f32", "bar\\.sync"),
    warps=8,
)


@pytest.mark.slow
def test_route_kernel_builds_for_sm90_with_one_release_counter():
    """The IQuest rank shape (E 256, H 3072) compiles; one acq_rel arrival per program after a
    barrier, IEEE divisions in the finish, no FMA contraction with fusion off."""
    off, on = fusion_counts(**SM90_ROUTE)
    got = {"False": off, "True": on}
    assert off["atom\\.acq_rel\\.gpu"] + off["atom\\.global\\.gpu\\.acq_rel"] == 1, got
    assert off["bar\\.sync"] >= 1 and off["div\\.rn\\.f32"] >= 2, got
    assert off["fma\\.rn\\.f32"] == 0, got
