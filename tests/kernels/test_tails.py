"""kernels/tails.py (attention tail + folded router, MoE tail) against the twins of
reference/twins/tails.py, the twins against reference/model.py ("bf16-fold"), broken variants,
poisoned outputs and padding, and the sm_90 build. Readiness and the ring: test_readiness.py.

Inputs: "grid" cases put the o_proj output a on a 1/16 grid (small integers split into integer
parts over the N partials), so every partial sum and every sum of squares of a is exact in any
order; an, h32 and h are then bit-exact on every backend and the router logits differ from the
twin's only by GEMM accumulation order. "gauss" cases are plain normal data. Padding rows of the
partials hold NaN or 3e38 and padding rows of xn / h hold NaN: any read of them shows. Outputs
start as POISON; live rows must be overwritten and padding rows must keep it.

Dimension letters: N partials, R rows, n live rows, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from iquestrt.capture import graph_capture
from kernels.fp8 import E4M3
from kernels.tails import RouterScratch, TailLaunch, attn_tail, moe_tail, tail_launch
from kernels.tails_launch import pow2
from kernels.timeline import SLOTS, SM_SLOT, new_trace
from qualification.tolerances import check, tolerance
from reference import ops
from reference.config import preset
from reference.model import ReferenceModel
from reference.synthetic import synthetic_params
from reference.twins.tails import (
    AttnTailOut,
    MoeTailOut,
    attn_tail_ref,
    attn_tail_router_input_ref,
    moe_tail_ref,
)

EPS = 1e-6
FFN_SCALE = 0.53881590608
POISON = 12288.0  # exact in bf16


@dataclass(frozen=True)
class Case:
    name: str
    npart: int
    rows: int
    n_live: int
    hidden: int
    experts: int = 0  # 0: no router
    top_k: int = 0
    grid: bool = True
    part_dtype: torch.dtype = torch.float32
    scale: float = 0.75  # attn_out_scale (1.0 in the model; 0.75 so a dropped scale shows)
    strided: bool = False  # partials / xn / h as row-padded views


CASES = (
    Case("tiny-8of8-N1", 1, 8, 8, 128, 16, 4),
    Case("tiny-5of8-N2", 2, 8, 5, 128, 16, 4),
    Case("tiny-1of8-N8", 8, 8, 1, 128, 16, 4),
    Case("tiny-6of8-N4-bf16parts", 4, 8, 6, 128, 16, 4, part_dtype=torch.bfloat16),
    Case("tiny-3of4-N3-gauss", 3, 4, 3, 128, grid=False, scale=1.0),
    # H not a power of two (masked columns, a partial router chunk), 3 router programs of 8,
    # K = 3 (masked top-k lanes), R = 7
    Case("odd-7of7-N3-strided", 3, 7, 7, 200, 24, 3, strided=True),
    Case("medium-6of8-N4", 4, 8, 6, 1024, 64, 8),
    Case("tp8-ring-6of8-N24", 24, 8, 6, 128, 16, 4),  # 8 ranks × 3 split-K partials
)
REAL = Case("real-8of8-N8", 8, 8, 8, 3072, 256, 8)


def make_inputs(case: Case, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n, r, h, npart = case.n_live, case.rows, case.hidden, case.npart
    if case.grid:
        a_int = torch.randint(-64, 65, (r, h), generator=gen)
        parts = torch.randint(-16, 17, (npart, r, h), generator=gen)
        parts[-1] = a_int - parts[:-1].sum(0)
        partials = parts.float() / 16  # exact in bf16 too (|int| ≤ 176)
    else:
        partials = torch.randn(npart, r, h, generator=gen) / npart**0.5
    partials[:, n::2] = float("nan")  # padding rows: never produced …
    partials[:, n + 1 :: 2] = 3e38  # … or garbage
    xn = torch.randn(r, h, generator=gen)
    xn[n:] = float("nan")
    d = {
        "partials": partials.to(case.part_dtype),
        "xn": xn.bfloat16(),
        "attn_out_norm": (1 + 0.05 * torch.randn(h, generator=gen)).bfloat16(),
        "ffn_norm": (1 + 0.05 * torch.randn(h, generator=gen)).bfloat16(),
        "next_norm": (1 + 0.05 * torch.randn(h, generator=gen)).bfloat16(),
        "h": torch.where(torch.arange(r)[:, None] < n, torch.randn(r, h, generator=gen),
                         float("nan")).bfloat16(),
        "n_live": torch.tensor([n], dtype=torch.int32),
    }
    if case.experts:
        d["router_w"] = torch.randn(case.experts, h, generator=gen) * 2 / h**0.5
    return d


def on(d: dict, device, strided: bool = False) -> dict:
    """To the device; strided: partials, xn and h become views with row stride H + 37."""
    out = {k: v.to(device) for k, v in d.items()}
    if strided:
        for k in ("partials", "xn", "h"):
            v = out[k]
            wide = torch.zeros(*v.shape[:-1], v.shape[-1] + 37, dtype=v.dtype, device=device)
            wide[..., 5 : 5 + v.shape[-1]] = v
            out[k] = wide[..., 5 : 5 + v.shape[-1]]
            assert not out[k].is_contiguous()
    return out


def poisoned_attn_out(case: Case, device) -> AttnTailOut:
    r, h, k = case.rows, case.hidden, case.top_k
    full = lambda *s, dt=torch.bfloat16: torch.full(s, POISON, dtype=dt, device=device)  # noqa: E731
    out = AttnTailOut(full(r, h), full(r, h))
    out.fq, out.sf = poisoned_quant(r, h, device)
    if case.experts:
        out.ids = torch.full((r, k), -7, dtype=torch.int32, device=device)
        out.weights = full(r, k, dt=torch.float32)
    return out


def poisoned_quant(r: int, h: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((r, h), 0x55, dtype=torch.uint8, device=device).view(E4M3),
            torch.full((r, -(-h // 128)), POISON, device=device))


def assert_quantized(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor, n: int, what: str):
    """q, s == reference quantize_act(x) on the live rows, bit for bit; padding rows poisoned."""
    q_want, s_want = ops.quantize_act(x.cpu()[:n])
    q_bytes = q.cpu().view(torch.uint8)
    assert torch.equal(q_bytes[:n], q_want.view(torch.uint8)), f"{what}: values != quantize_act"
    assert torch.equal(s.cpu()[:n], s_want), f"{what}: scales != quantize_act"
    assert (q_bytes[n:] == 0x55).all() and (s.cpu()[n:] == POISON).all(), \
        f"{what}: padding rows were written"


def assert_written(t: torch.Tensor, n: int, what: str, poison=POISON) -> None:
    t = t.cpu().float()
    assert torch.isfinite(t[:n]).all() and (t[:n] != poison).all(), f"{what}: live rows not written"
    assert (t[n:] == poison).all(), f"{what}: padding rows were written"


def run_attn(case: Case, d: dict, device, config: TailLaunch | None = None):
    """→ (kernel out, scratch, flag, polls, rearm buffer) on the device."""
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    polls = torch.zeros(case.rows, dtype=torch.int32, device=device)
    rearm = torch.full((case.rows, case.hidden), 5.0, dtype=case.part_dtype, device=device)
    scratch = (RouterScratch.create(case.hidden, case.experts, device)
               if case.experts else None)
    out = attn_tail(
        d["partials"], d["xn"], d["attn_out_norm"], d["ffn_norm"], d["n_live"], flag,
        eps=EPS, attn_out_scale=case.scale, max_polls=4, rearm=rearm,
        router_w=d.get("router_w"), top_k=case.top_k, scratch=scratch,
        out=poisoned_attn_out(case, device), polls=polls, config=config, quantize=True)
    return out, scratch, flag, polls, rearm


def twin_attn(case: Case, d: dict) -> AttnTailOut:
    return attn_tail_ref(d["partials"], d["xn"], d["attn_out_norm"], d["ffn_norm"], d["n_live"],
                         eps=EPS, attn_out_scale=case.scale, router_w=d.get("router_w"),
                         top_k=case.top_k)


def twin_logits(case: Case, d: dict) -> torch.Tensor:
    r_in = attn_tail_router_input_ref(d["partials"], d["xn"], d["attn_out_norm"], d["ffn_norm"],
                                      d["n_live"], eps=EPS, attn_out_scale=case.scale)
    return r_in @ d["router_w"].cpu().t()  # [n, E], the FP32 GEMM of ops.route


def check_routing(case: Case, out: AttnTailOut, logits: torch.Tensor, twin_l: torch.Tensor,
                  twin: AttnTailOut) -> dict[str, object]:
    """Logits within band; ids exact vs ops.route on the kernel's logits; vs the twin's ids
    wherever the top-k is not a near-tie (and near-tie rows still pick from the near-tied set)."""
    n, k, e = case.n_live, case.top_k, case.experts
    rep: dict[str, object] = {"logits": check(logits, twin_l, "kernels.router.logits", "fp32")}
    w_own, ids_own = ops.route(logits, torch.eye(e), k)  # logits @ I is exact
    check(out.ids.cpu()[:n], ids_own.to(torch.int32), "kernels.router.ids", "int32")
    rep["weights"] = check(out.weights.cpu()[:n], w_own, "kernels.router.weights", "fp32")
    band = 2 * tolerance("kernels.router.logits", "fp32").max_rel * twin_l.abs().max().item()
    srt = twin_l.sort(dim=-1, descending=True, stable=True).values[:, : k + 1]
    clear = ((srt[:, :-1] - srt[:, 1:]) > band).all(-1)  # [n]
    ids = out.ids.cpu()[:n]
    assert torch.equal(ids[clear], twin.ids[clear]), "ids differ from the twin on a clear top-k"
    for row in torch.nonzero(~clear).flatten().tolist():
        picked = twin_l[row, ids[row].long()]
        assert (picked >= srt[row, k - 1] - band).all(), f"row {row}: picked outside the near-tie"
    rep["near_tie_rows"] = f"{int((~clear).sum())} of {n} (band {band:.2e})"
    return rep


def nan_launch(case: Case) -> TailLaunch:
    """The pinned launch with the router's NaN-readiness wait, the full-tile finish and the
    weights loaded per chunk: the variants are weighed against it (bit-identical to it, or
    within its tolerance rows)."""
    return replace(tail_launch(case.hidden, case.experts), count_ready=False,
                   group_finish=False, prefetch_w=False)


def assert_scratch_restored(case: Case, scratch: RouterScratch) -> None:
    """The scratch invariant after a pinned launch: both counters 0; r_in all NaN again with
    the NaN wait, the live rows' router input left as written with the ready counter."""
    assert scratch.counter.item() == 0 and scratch.ready.item() == 0, "counters not reset"
    r_in = scratch.r_in.cpu()
    if tail_launch(case.hidden, case.experts).count_ready:
        assert torch.isfinite(r_in[:case.n_live]).all(), "r_in: the live rows' router input"
    else:
        assert torch.isnan(r_in).all(), "r_in not re-armed with NaN"


def run_case(case: Case, seed: int, device) -> dict[str, object]:
    d_cpu = make_inputs(case, seed)
    d = on(d_cpu, device, case.strided)
    n = case.n_live
    out, scratch, flag, polls, rearm = run_attn(case, d, device)
    twin = twin_attn(case, d_cpu)
    assert flag.item() == 0 and (polls.cpu() == 1).all(), (flag, polls)
    assert torch.isnan(rearm.cpu().float()).all(), "re-arm must cover all R rows"
    assert_written(out.h, n, "h")
    assert_written(out.f_in, n, "f_in")
    assert_quantized(out.fq, out.sf, out.f_in, n, "f_in's quantization")
    rep: dict[str, object] = {
        "h": check(out.h.cpu()[:n], twin.h, "kernels.residual_norm.attn_tail", "bf16"),
        "f_in": check(out.f_in.cpu()[:n], twin.f_in, "kernels.residual_norm.attn_tail", "bf16"),
    }
    if case.grid:
        rep["h exact"] = check(out.h.cpu()[:n], twin.h, "kernels.residual_norm.exact", "bf16")
    if case.experts:
        assert_written(out.weights, n, "weights")
        ids = out.ids.cpu()
        assert (ids[:n] >= 0).all() and (ids[:n] < case.experts).all() and (ids[n:] == -7).all()
        assert_scratch_restored(case, scratch)
        rep |= check_routing(case, out, scratch.logits.cpu()[:n], twin_logits(case, d_cpu), twin)
    # MoE tail on the same partials, with the layer output x written too
    mo = MoeTailOut(torch.full((case.rows, case.hidden), POISON, dtype=torch.bfloat16,
                               device=device),
                    torch.full((case.rows, case.hidden), POISON, dtype=torch.bfloat16,
                               device=device))
    mo.xq, mo.sx = poisoned_quant(case.rows, case.hidden, device)
    moe_tail(d["partials"], d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
             ffn_out_scale=FFN_SCALE, max_polls=4, out=mo, polls=polls, quantize=True)
    assert_quantized(mo.xq, mo.sx, mo.xn, n, "xn''s quantization")
    mt = moe_tail_ref(d["partials"], d["h"], d["next_norm"], d["n_live"], eps=EPS,
                      ffn_out_scale=FFN_SCALE)
    assert flag.item() == 0
    assert_written(mo.xn, n, "xn'")
    assert_written(mo.x, n, "x")
    rep["moe x exact"] = check(mo.x.cpu()[:n], mt.x, "kernels.residual_norm.exact", "bf16")
    rep["moe xn'"] = check(mo.xn.cpu()[:n], mt.xn, "kernels.residual_norm.moe_tail", "bf16")
    return rep


def report(name: str, rep: dict, t0: float) -> None:
    print(f"\n[{name}] {time.perf_counter() - t0:.2f}s")
    for key, val in rep.items():
        print(f"  {key}: {val}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tails_match_twins(case, device):
    t0 = time.perf_counter()
    report(case.name, run_case(case, 10 + CASES.index(case), device), t0)


@pytest.mark.gpu
@pytest.mark.parametrize("n_live", [1, 6, 8])
def test_real_shape_matches_twins_gpu(n_live, device):
    case = replace(REAL, name=f"real-{n_live}of8-N8", n_live=n_live)
    t0 = time.perf_counter()
    report(case.name, run_case(case, 50 + n_live, device), t0)
    report(case.name + "-gauss-N1", run_case(replace(case, npart=1, experts=0, top_k=0,
                                                     grid=False), 60 + n_live, device), t0)


@pytest.mark.parametrize("case", [c for c in CASES if c.experts], ids=lambda c: c.name)
@pytest.mark.slow
def test_unrolled_router_poll(case, device):
    """TailLaunch.unroll_k polls the whole router input per poll and reduces the products once:
    h and f_in are the default launch's bits, the logits stay within the router's tolerance row
    of the twin and the ids/weights follow ops.route on them (check_routing), and the scratch
    invariant is restored."""
    d_cpu = make_inputs(case, 70 + CASES.index(case))
    d = on(d_cpu, device, case.strided)
    base = nan_launch(case)
    n = case.n_live
    ref, _, _, _, _ = run_attn(case, d, device, base)
    out, scratch, flag, _, _ = run_attn(case, d, device, replace(base, unroll_k=True))
    assert flag.item() == 0
    assert torch.isnan(scratch.r_in.cpu()).all() and scratch.counter.item() == 0
    for a, b in ((out.h, ref.h), (out.f_in, ref.f_in)):
        assert torch.equal(a.cpu()[:n].view(torch.int16), b.cpu()[:n].view(torch.int16))
    check_routing(case, out, scratch.logits.cpu()[:n], twin_logits(case, d_cpu),
                  twin_attn(case, d_cpu))


TOPK_CASES = [c for c in CASES if c.experts][:3] + [CASES[5], CASES[6], REAL]


def tied_router(case: Case, seed: int, device):
    """Inputs whose router rows tie: experts 1 and 2 share a (large) row, 3 and 4 its negation,
    and with more than 33 experts expert 33 (another group of 32) ties with 1 and 2 too →
    (cpu inputs, device inputs)."""
    if device.type == "cpu" and case is REAL:
        pytest.skip("the real shape is slow under the interpreter; a GPU runs it")
    d_cpu = make_inputs(case, seed)
    w = d_cpu["router_w"]
    w[1] *= 6  # two tied pairs of large opposite logits: one of them tops every row
    w[2], w[3], w[4] = w[1], -w[1], -w[1]
    if case.experts > 33:
        w[33] = w[1]
    return d_cpu, on(d_cpu, device, case.strided)


def assert_ties_in_order(case: Case, ids: torch.Tensor) -> None:
    """A tied pair in the top-k sits adjacent, lower index first; 33 right after 2."""
    pairs = 0
    for r in ids.tolist():
        for lo in (1, 3):
            if lo in r and lo + 1 in r:
                assert r.index(lo + 1) == r.index(lo) + 1, r
                pairs += 1
        if 33 in r and 2 in r and case.experts > 33:
            assert r.index(33) == r.index(2) + 1, r
    assert pairs >= 1


@pytest.mark.parametrize("case", TOPK_CASES, ids=lambda c: c.name)
def test_packed_topk_finish_is_bit_identical(case, device):
    """TailLaunch.packed_topk (one int64 max per top-k step) picks the same experts in the same
    order with the same weights as the two-reduction finish — ties included (tied_router)."""
    d_cpu, d = tied_router(case, 90 + CASES.index(case) if case in CASES else 99, device)
    base = nan_launch(case)
    ref, _, _, _, _ = run_attn(case, d, device, base)
    out, scratch, fail, _, _ = run_attn(case, d, device, replace(base, packed_topk=True))
    assert fail.item() == 0
    assert torch.isnan(scratch.r_in.cpu()).all() and scratch.counter.item() == 0
    n = case.n_live
    assert torch.equal(out.ids.cpu()[:n], ref.ids.cpu()[:n])
    assert torch.equal(out.weights.cpu()[:n], ref.weights.cpu()[:n])
    assert_ties_in_order(case, out.ids.cpu()[:n])


@pytest.mark.parametrize("count", [False, True], ids=["nan", "counter"])
@pytest.mark.parametrize("case", TOPK_CASES, ids=lambda c: c.name)
def test_group_finish_picks_the_same_experts(case, count, device):
    """TailLaunch.group_finish (softmax and top-k over warp-sized tiles): the same ids as the
    two-reduction finish, ties included (tied_router); the weights within the
    kernels.router.weights row of it (its sums add in another order) and of ops.route on the
    kernel's own logits (check_routing); the same logits, h and f_in bits; the scratch
    invariant restored with either wait."""
    d_cpu, d = tied_router(case, 110 + CASES.index(case) if case in CASES else 119, device)
    base = replace(nan_launch(case), count_ready=count)
    ref, ref_scratch, _, _, _ = run_attn(case, d, device, base)
    out, scratch, fail, _, _ = run_attn(case, d, device, replace(base, group_finish=True))
    assert fail.item() == 0
    assert scratch.counter.item() == 0 and scratch.ready.item() == 0
    assert torch.isnan(scratch.r_in.cpu()).all() != count
    n = case.n_live
    assert torch.equal(out.ids.cpu()[:n], ref.ids.cpu()[:n])
    check(out.weights.cpu()[:n], ref.weights.cpu()[:n], "kernels.router.weights", "fp32")
    assert torch.equal(scratch.logits.cpu()[:n], ref_scratch.logits.cpu()[:n])
    for a, b in ((out.h, ref.h), (out.f_in, ref.f_in)):
        assert torch.equal(a.cpu()[:n].view(torch.int16), b.cpu()[:n].view(torch.int16))
    assert_ties_in_order(case, out.ids.cpu()[:n])
    check_routing(case, out, scratch.logits.cpu()[:n], twin_logits(case, d_cpu),
                  twin_attn(case, d_cpu))


def test_group_finish_marks_nonfinite_rows(device):
    """Rows whose logits are not finite: the group finish gives them ids −1 and NaN weights and
    raises the failure flag, as the steps do."""
    case = CASES[1]
    d_cpu = make_inputs(case, 7)
    d_cpu["router_w"][5] = 3e38  # finite weights whose products overflow FP32
    d = on(d_cpu, device, case.strided)
    base = nan_launch(case)
    ref, _, ref_fail, _, _ = run_attn(case, d, device, base)
    out, _, fail, _, _ = run_attn(case, d, device, replace(base, group_finish=True))
    assert ref_fail.item() == 1 and fail.item() == 1
    n = case.n_live
    assert torch.equal(out.ids.cpu()[:n], ref.ids.cpu()[:n])
    assert (out.ids.cpu()[:n] == -1).any()
    assert torch.equal(torch.isnan(out.weights.cpu()[:n]), torch.isnan(ref.weights.cpu()[:n]))


@pytest.mark.parametrize("unroll", [False, True], ids=["chunked", "unrolled"])
@pytest.mark.parametrize("case", [CASES[1], CASES[5], REAL], ids=lambda c: c.name)
def test_prefetched_router_weights_are_bit_identical(case, unroll, device):
    """TailLaunch.prefetch_w loads every weight chunk before the first wait: the same products
    summed in the same order, so logits, ids and weights equal the bits of the launch without
    it, chunked or unrolled poll (at 4 chunks of 32 / 64 columns on the small shapes, the
    pinned 3 × 1024 at the real one)."""
    if device.type == "cpu" and case is REAL:
        pytest.skip("the real shape is slow under the interpreter; a GPU runs it")
    d_cpu = make_inputs(case, 110 + (CASES.index(case) if case in CASES else 9))
    d = on(d_cpu, device, case.strided)
    base = replace(nan_launch(case), unroll_k=unroll)
    if case is not REAL:
        base = replace(base, block_k=pow2(-(-case.hidden // 4)))
    n = case.n_live
    ref, ref_scratch, _, _, _ = run_attn(case, d, device, base)
    ref_logits = ref_scratch.logits.cpu()[:n]
    out, scratch, flag, _, _ = run_attn(case, d, device, replace(base, prefetch_w=True))
    assert flag.item() == 0
    assert torch.isnan(scratch.r_in.cpu()).all() and scratch.counter.item() == 0
    assert torch.equal(scratch.logits.cpu()[:n].view(torch.int32), ref_logits.view(torch.int32))
    assert torch.equal(out.ids.cpu()[:n], ref.ids.cpu()[:n])
    assert torch.equal(out.weights.cpu()[:n].view(torch.int32),
                       ref.weights.cpu()[:n].view(torch.int32))
    check_routing(case, out, scratch.logits.cpu()[:n], twin_logits(case, d_cpu),
                  twin_attn(case, d_cpu))


def test_prefetch_and_trace_errors(device):
    case = CASES[1]
    d = on(make_inputs(case, 6), device)
    base = tail_launch(case.hidden, case.experts)
    with pytest.raises(ValueError,
                       match=r"prefetch_w: needs at most 4 chunks of block_k 16 over H 128"):
        run_attn(case, d, device, replace(base, prefetch_w=True, block_k=16))
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    if device.type == "cpu":
        trace = torch.zeros(case.rows, SLOTS, dtype=torch.int64)
        with pytest.raises(ValueError, match="trace: kernel timestamps need the launch's CUDA"):
            moe_tail(d["partials"], d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
                     ffn_out_scale=1.0, max_polls=4, trace=trace)
        with pytest.raises(ValueError, match="trace: kernel timestamps need a CUDA device"):
            new_trace(case.rows, device)
    else:
        with pytest.raises(ValueError, match=r"trace: expected a contiguous int64 \[8, 12\]"):
            moe_tail(d["partials"], d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
                     ffn_out_scale=1.0, max_polls=4, trace=new_trace(case.rows + 1, device))


@pytest.mark.gpu
def test_traced_launch_orders_its_stamps_gpu(device):
    """A traced attention tail (real shape, 6 of 8 rows) computes the untraced launch's bits,
    and its stamps follow the kernel's causality: within each program in program order; every
    router program's logits after every live row had summed its partials (the rows' router
    input is stored after that stamp, the router waited for it); the one routing program
    (slot 3 set) arrived after every router program had its logits. The MoE tail likewise."""
    case = replace(REAL, name="real-6of8-N8", n_live=6)
    d = on(make_inputs(case, 120), device)
    base = tail_launch(case.hidden, case.experts)
    ref, ref_scratch, _, _, _ = run_attn(case, d, device, base)
    ref_logits = ref_scratch.logits.clone()
    n_route = -(-case.experts // base.block_e)
    trace = new_trace(case.rows + n_route, device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    scratch = RouterScratch.create(case.hidden, case.experts, device)
    out = attn_tail(d["partials"], d["xn"], d["attn_out_norm"], d["ffn_norm"], d["n_live"],
                    flag, eps=EPS, attn_out_scale=case.scale, max_polls=4,
                    rearm=torch.full((case.rows, case.hidden), 5.0, device=device),
                    router_w=d["router_w"], top_k=case.top_k, scratch=scratch,
                    out=poisoned_attn_out(case, device), config=base, quantize=True,
                    trace=trace)
    torch.cuda.synchronize()
    assert flag.item() == 0
    for a, b in ((out.h, ref.h), (out.f_in, ref.f_in), (out.fq, ref.fq), (out.sf, ref.sf),
                 (out.ids, ref.ids), (out.weights, ref.weights), (scratch.logits, ref_logits)):
        assert torch.equal(a[:6].cpu().view(torch.uint8), b[:6].cpu().view(torch.uint8))
    t = trace.cpu()
    rows, route = t[:case.rows], t[case.rows:]
    assert (rows[:, :4] > 0).all() and (route[:, :3] > 0).all()
    assert (rows[:, :3] <= rows[:, 1:4]).all() and (route[:, :2] <= route[:, 1:3]).all()
    assert (route[:, 1] >= rows[:6, 1].max()).all()
    # the input seen (slot 8) after every live row summed, before the program's logits
    assert (route[:, 8] >= rows[:6, 1].max()).all() and (route[:, 8] <= route[:, 1]).all()
    assert (rows[:, 8] == 0).all()
    last = (route[:, 3] > 0).nonzero().flatten()
    assert last.numel() == 1
    assert route[last, 2] >= route[:, 1].max() and route[last, 3] >= route[last, 2]
    finish = route[last, [2, 4, 5, 6, 3]].flatten()  # arrived, softmax, top-k, stored, routed
    assert (finish[:-1] <= finish[1:]).all(), finish
    assert (route[:, 4:7].sum(dim=0) == route[last, 4:7].flatten()).all(), "only the last finishes"
    sm = t[:, SM_SLOT]
    assert ((sm >= 0) & (sm < torch.cuda.get_device_properties(0).multi_processor_count)).all()
    # one program per row (the pinned launch runs rows in column chunks: more programs, whose
    # stamps tests/kernels/test_row_chunks.py does not read)
    rows_cfg = replace(base, moe_chunk_groups=0)
    mo_trace = new_trace(case.rows, device)
    mo = moe_tail(d["partials"], d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
                  ffn_out_scale=FFN_SCALE, max_polls=4, quantize=True, trace=mo_trace,
                  config=rows_cfg)
    plain = moe_tail(d["partials"], d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
                     ffn_out_scale=FFN_SCALE, max_polls=4, quantize=True, config=rows_cfg)
    torch.cuda.synchronize()
    assert torch.equal(mo.xn[:6].cpu().view(torch.int16), plain.xn[:6].cpu().view(torch.int16))
    m = mo_trace.cpu()
    assert (m[:, :4] > 0).all() and (m[:, :3] <= m[:, 1:4]).all()


@pytest.mark.parametrize("case", [CASES[1], CASES[5], REAL], ids=lambda c: c.name)
@pytest.mark.parametrize("prefetch", [False, True], ids=["loaded", "prefetched"])
def test_ready_counter_router_is_bit_identical(case, prefetch, device):
    """TailLaunch.count_ready: router programs wait on the row programs' counter instead of
    polling r_in for NaN, then sum the chunked path's products in its order — logits, ids,
    weights, h and f_in are the NaN launch's bits; both counters end at 0 and r_in is left as
    written (not re-armed), and a second launch on the same scratch gives the same bits."""
    if device.type == "cpu" and case is REAL:
        pytest.skip("the real shape is slow under the interpreter; a GPU runs it")
    d_cpu = make_inputs(case, 130 + (CASES.index(case) if case in CASES else 9))
    d = on(d_cpu, device, case.strided)
    base = nan_launch(case)
    if case is not REAL:
        base = replace(base, block_k=pow2(-(-case.hidden // 4)))
    n = case.n_live
    ref, ref_scratch, _, _, _ = run_attn(case, d, device, base)
    cfg = replace(base, count_ready=True, prefetch_w=prefetch)
    out, scratch, flag, polls, _ = run_attn(case, d, device, cfg)
    assert flag.item() == 0 and (polls.cpu() == 1).all()
    assert scratch.counter.item() == 0 and scratch.ready.item() == 0
    assert torch.isfinite(scratch.r_in.cpu()[:n]).all(), "r_in: the live rows' router input"
    bits = lambda t: t.cpu()[:n].contiguous().view(torch.uint8)  # noqa: E731
    for a, b in ((scratch.logits, ref_scratch.logits), (out.ids, ref.ids),
                 (out.weights, ref.weights), (out.h, ref.h), (out.f_in, ref.f_in),
                 (out.fq, ref.fq), (out.sf, ref.sf)):
        assert torch.equal(bits(a), bits(b))
    again = attn_tail(d["partials"], d["xn"], d["attn_out_norm"], d["ffn_norm"], d["n_live"],
                      flag, eps=EPS, attn_out_scale=case.scale, max_polls=4,
                      router_w=d["router_w"], top_k=case.top_k, scratch=scratch, config=cfg)
    assert flag.item() == 0 and scratch.ready.item() == 0 and scratch.counter.item() == 0
    assert torch.equal(bits(again.ids), bits(ref.ids))
    assert torch.equal(bits(again.weights), bits(ref.weights))


def test_two_topk_finishes_at_once_are_refused():
    with pytest.raises(ValueError, match="packed_topk and group_finish are two ways of one"):
        TailLaunch(packed_topk=True, group_finish=True)


def test_ready_counter_wait_is_bounded(device):
    """A ready counter that cannot reach the row count (corrupted to −100 before the launch):
    every router program gives up after router_max_polls reads — the failure flag is raised,
    every live row gets ids −1 and NaN weights, h / f_in are still the row programs' bits, and
    the finish puts both counters back to 0 (no hang, no half-published routing)."""
    case = CASES[1]
    d = on(make_inputs(case, 140), device)
    cfg = replace(tail_launch(case.hidden, case.experts), count_ready=True)
    ref, _, _, _, _ = run_attn(case, d, device, cfg)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    scratch = RouterScratch.create(case.hidden, case.experts, device)
    scratch.ready.fill_(-100)
    out = attn_tail(d["partials"], d["xn"], d["attn_out_norm"], d["ffn_norm"], d["n_live"],
                    flag, eps=EPS, attn_out_scale=case.scale, max_polls=4,
                    router_w=d["router_w"], top_k=case.top_k, scratch=scratch,
                    out=poisoned_attn_out(case, device), config=cfg, router_max_polls=3)
    n = case.n_live
    assert flag.item() == 1
    assert (out.ids.cpu()[:n] == -1).all() and torch.isnan(out.weights.cpu()[:n]).all()
    assert torch.equal(out.h.cpu()[:n].view(torch.int16), ref.h.cpu()[:n].view(torch.int16))
    assert scratch.ready.item() == 0 and scratch.counter.item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("change", [dict(unroll_k=True), dict(block_k=512),
                                    dict(block_k=512, block_e=2), dict(block_k=1024, block_e=2),
                                    dict(unroll_k=True, block_k=256), dict(count_ready=True),
                                    dict(count_ready=True, block_e=4)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_router_launch_variants_at_the_real_shape_gpu(change, device):
    """The router launch configurations bench_tails --sweep times, checked first: 6 of 8 rows,
    N = 8, H 3072, E 256, K 8 — logits within the router row of the twin, ids/weights exact on
    them, h/f_in unchanged."""
    case = replace(REAL, name="real-6of8-N8", n_live=6)
    d_cpu = make_inputs(case, 80)
    d = on(d_cpu, device, case.strided)
    base = nan_launch(case)
    ref, _, _, _, _ = run_attn(case, d, device, base)
    out, scratch, flag, _, _ = run_attn(case, d, device, replace(base, **change))
    assert flag.item() == 0
    assert scratch.counter.item() == 0 and scratch.ready.item() == 0
    assert change.get("count_ready") or torch.isnan(scratch.r_in.cpu()).all()
    for a, b in ((out.h, ref.h), (out.f_in, ref.f_in)):
        assert torch.equal(a.cpu()[:6].view(torch.int16), b.cpu()[:6].view(torch.int16))
    check_routing(case, out, scratch.logits.cpu()[:6], twin_logits(case, d_cpu),
                  twin_attn(case, d_cpu))


def test_padded_width_is_bit_identical(device):
    """5 live rows in an 8-row buffer give the bits of a 5-row buffer (router included)."""
    case = CASES[1]
    d = on(make_inputs(case, 3), device)
    padded, sp, *_ = run_attn(case, d, device)
    exact_case = replace(case, rows=5)
    de = {k: (v[:, :5] if k == "partials" else v[:5] if k in ("xn", "h") else v)
          for k, v in d.items()}
    exact, se, *_ = run_attn(exact_case, de, device)
    for field in ("h", "f_in", "ids", "weights"):
        a, b = getattr(padded, field)[:5].cpu(), getattr(exact, field).cpu()
        assert torch.equal(a.view(torch.int8), b.view(torch.int8)), field
    assert torch.equal(sp.logits[:5].cpu(), se.logits[:5].cpu())


@pytest.mark.gpu
def test_cuda_graph_replay_and_no_host_sync_gpu(device):
    """Both tails in one CUDA graph (no host sync inside), replayed for n_live 3, 8, 1: each
    replay equals the twin, the scratch invariant holds and padding rows stay poisoned."""
    case = replace(REAL, name="graph")
    d_cpu = make_inputs(case, 70)
    d = on(d_cpu, device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    scratch = RouterScratch.create(case.hidden, case.experts, device)
    out = poisoned_attn_out(case, device)
    mo = MoeTailOut(torch.empty(8, case.hidden, dtype=torch.bfloat16, device=device))
    n_live = torch.tensor([8], dtype=torch.int32, device=device)
    parts = d["partials"].nan_to_num(0.0)  # every row written (n_live varies per replay)

    def both():
        attn_tail(parts, d["xn"].nan_to_num(0.0), d["attn_out_norm"], d["ffn_norm"], n_live,
                  flag, eps=EPS, attn_out_scale=1.0, max_polls=1 << 20,
                  router_w=d["router_w"], top_k=8, scratch=scratch, out=out)
        moe_tail(parts, out.h, d["next_norm"], n_live, flag, eps=EPS, ffn_out_scale=FFN_SCALE,
                 max_polls=1 << 20, out=mo)

    both()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        both()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        both()
    for live in (3, 8, 1):
        for t in (out.h, out.f_in, out.weights):
            t.fill_(POISON)
        n_live.fill_(live)
        graph.replay()
        torch.cuda.synchronize()
        assert flag.item() == 0
        twin = attn_tail_ref(parts.cpu(), d_cpu["xn"].nan_to_num(0.0), d_cpu["attn_out_norm"],
                             d_cpu["ffn_norm"], live, eps=EPS, attn_out_scale=1.0,
                             router_w=d_cpu["router_w"], top_k=8)
        assert_written(out.h, live, f"h (n={live})")
        check(out.h.cpu()[:live], twin.h, "kernels.residual_norm.exact", "bf16")
        check(out.f_in.cpu()[:live], twin.f_in, "kernels.residual_norm.attn_tail", "bf16")
        w_own, ids_own = ops.route(scratch.logits.cpu()[:live], torch.eye(case.experts), 8)
        check(out.ids.cpu()[:live], ids_own.int(), "kernels.router.ids", "int32")
        check(out.weights.cpu()[:live], w_own, "kernels.router.weights", "fp32")
        assert_scratch_restored(replace(case, n_live=live), scratch)
        mt = moe_tail_ref(parts.cpu(), out.h.cpu(), d_cpu["next_norm"], live, eps=EPS,
                          ffn_out_scale=FFN_SCALE)
        check(mo.xn.cpu()[:live], mt.xn, "kernels.residual_norm.moe_tail", "bf16")


@pytest.mark.gpu
def test_moe_tail_release_and_prefetching_qkv_change_no_bit_gpu(device):
    """TailLaunch.moe_release + LinearLaunch.prefetch_w under PDL, in one CUDA graph: the MoE
    tail releases the QKV projection at its start, the projection's programs prefetch their
    weights and then wait — so they run beside the tail and must still read the x it quantizes
    only after it completed. Against the same two launches with PDL alone, over replays whose
    tail inputs change (a stale x would show) at n_live 8, 6, 1: the same bits."""
    from kernels.linear import linear_fp8_launch, linear_fp8_partials, linear_fp8_splits

    case = replace(REAL, name="release")
    d = on(make_inputs(case, 71), device)
    gen = torch.Generator().manual_seed(72)
    w = (torch.randn(1024, 3072, generator=gen) * 64).clamp(-448, 448).to(E4M3).to(device)
    ws = (torch.rand(8, 24, generator=gen) + 0.5).to(device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    n_live = torch.tensor([8], dtype=torch.int32, device=device)
    parts = d["partials"].nan_to_num(0.0)
    h = d["xn"].nan_to_num(0.0)
    pinned_t, pinned_l = tail_launch(3072, 256), linear_fp8_launch(1024, 3072)
    runs = {}
    for name, tcfg, lcfg in (("pdl", pinned_t, pinned_l),
                             ("release", replace(pinned_t, moe_release=True),
                              replace(pinned_l, prefetch_w=True))):
        mo = MoeTailOut(torch.empty(8, 3072, dtype=torch.bfloat16, device=device))
        out = torch.full((linear_fp8_splits(1024, 3072, lcfg), 8, 1024), float("nan"),
                         device=device)

        def step(mo=mo, out=out, tcfg=tcfg, lcfg=lcfg):
            moe_tail(parts, h, d["next_norm"], n_live, flag, eps=EPS, ffn_out_scale=FFN_SCALE,
                     max_polls=1 << 20, out=mo, quantize=True, config=tcfg, pdl=True)
            linear_fp8_partials(mo.xn, w, ws, n_live, out=out, quantized=(mo.xq, mo.sx),
                                config=lcfg, pdl=True)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph):
            step()
        runs[name] = (graph, out)
    base = parts.clone()
    for i, live in enumerate((8, 6, 1)):
        parts.copy_(base * (1.0 + 0.25 * i))  # new tail inputs each replay
        n_live.fill_(live)
        got = {}
        for name, (graph, out) in runs.items():
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            got[name] = out[:, :live].cpu().view(torch.int32)
        assert flag.item() == 0
        assert not torch.isnan(got["pdl"].view(torch.float32)).any()
        assert torch.equal(got["release"], got["pdl"]), f"n_live {live}"


@pytest.mark.gpu
def test_bench_attn_tail_router(benchmark):
    """Attention tail + folded router, 6 live rows, N = 8 partials, H 3072, E 256, K 8; a graph
    of 40 calls cycling 40 router copies (120 MB ≫ L2). Divide the reported time by 40."""
    from benchmarks.bench_tails import Spec, build, capture_graph, check_against_twin, kernel_call

    p = build(Spec("attn+router", rows=6, npart=8), torch.device("cuda"))
    check_against_twin(p)
    graph = capture_graph([kernel_call(p, j) for j in range(len(p.router_w))], reps=40)

    def step():
        graph.replay()
        torch.cuda.synchronize()

    benchmark(step)
    assert p.flag.item() == 0


# --- broken variants: each tolerance row shown failing --------------------------------------


def mutant_attn(case: Case, d: dict, *, unrounded_f_in=False, unrounded_an=False, scale=None,
                bf16_router=False):
    """attn_tail_ref with one rounding point or step broken → (h, f_in, logits) of live rows."""
    n, p = case.n_live, d["partials"]
    a = sum(p[i, :n].float() for i in range(p.shape[0])).bfloat16()
    an = ops.rms_norm(a, d["attn_out_norm"], EPS,
                      out_dtype=torch.float32 if unrounded_an else None)
    h32 = d["xn"][:n].float() + an.float() * (case.scale if scale is None else scale)
    h = h32.bfloat16()
    f_in = ops.rms_norm(h32 if unrounded_f_in else h, d["ffn_norm"], EPS,
                        out_dtype=torch.bfloat16)
    logits = None
    if case.experts:
        r_in = f_in.float() if bf16_router else ops.rms_norm(h32, d["ffn_norm"], EPS)
        logits = r_in @ d["router_w"].t()
    return h, f_in, logits


def fails(fn) -> str:
    with pytest.raises(AssertionError) as err:
        fn()
    return str(err.value).split(";")[0]


def test_broken_variants_exceed_their_rows(device):
    case = Case("tiny-8of8-N2", 2, 8, 8, 128, 16, 4, grid=False)
    d_cpu = make_inputs(case, 21)
    d = on(d_cpu, device)
    out, scratch, *_ = run_attn(case, d, device)
    h, f_in = out.h.cpu(), out.f_in.cpu()
    got: dict[str, str] = {}
    row = "kernels.residual_norm.attn_tail"
    _, f_bad, *_ = mutant_attn(case, d_cpu, unrounded_f_in=True)
    got["f_in from FP32 h32"] = fails(lambda: check(f_in, f_bad, row, "bf16"))
    h_bad, *_ = mutant_attn(case, d_cpu, unrounded_an=True)
    got["an not rounded"] = fails(lambda: check(h, h_bad, row, "bf16"))
    h_bad, *_ = mutant_attn(case, d_cpu, scale=1.0)
    got["attn_out_scale dropped"] = fails(lambda: check(h, h_bad, row, "bf16"))

    grid_case = replace(case, grid=True)
    dg_cpu = make_inputs(grid_case, 22)
    dg_cpu["router_w"][9] = dg_cpu["router_w"][3] = 3 * dg_cpu["router_w"][3]  # exact tie, top
    og, sg, *_ = run_attn(grid_case, on(dg_cpu, device), device)
    logits, ids = sg.logits.cpu(), og.ids.cpu()
    n = grid_case.n_live
    a = sum(dg_cpu["partials"][i, :n].float() for i in range(2)).bfloat16()
    h32 = dg_cpu["xn"][:n].float() + ops.rms_norm(a, dg_cpu["attn_out_norm"], EPS).float() * 0.75
    truncated = (h32.view(torch.int32) & -65536).view(torch.float32).bfloat16()  # exact cast
    check(og.h.cpu(), h32.bfloat16(), "kernels.residual_norm.exact", "bf16")
    got["h by truncation"] = fails(
        lambda: check(og.h.cpu(), truncated, "kernels.residual_norm.exact", "bf16"))
    assert torch.equal(logits[:, 3], logits[:, 9])
    _, _, l_bad = mutant_attn(grid_case, dg_cpu, bf16_router=True)
    got["router on bf16 f_in"] = fails(
        lambda: check(logits, l_bad, "kernels.router.logits", "fp32"))
    probs = torch.softmax(logits, -1).sort(dim=-1, descending=True, stable=True).values[:, :4]
    got["weights not renormalized"] = fails(
        lambda: check(og.weights.cpu(), probs, "kernels.router.weights", "fp32"))
    check(ids, ops.route(logits, torch.eye(16), 4)[1].int(), "kernels.router.ids", "int32")
    high_first = 15 - ops.route(logits.flip(-1), torch.eye(16), 4)[1].int()
    got["ties by higher index"] = fails(
        lambda: check(ids, high_first, "kernels.router.ids", "int32"))

    # MoE tail
    mo = moe_tail(d["partials"], d["h"], d["next_norm"], d["n_live"],
                  torch.zeros(1, dtype=torch.int32, device=device), eps=EPS,
                  ffn_out_scale=FFN_SCALE, max_polls=2).xn.cpu()
    f = sum(d_cpu["partials"][i].float() for i in range(2))
    x32 = d_cpu["h"].float() + f.bfloat16().float() * FFN_SCALE
    got["xn' from FP32 x"] = fails(lambda: check(
        mo, ops.rms_norm(x32, d_cpu["next_norm"], EPS, out_dtype=torch.bfloat16),
        "kernels.residual_norm.moe_tail", "bf16"))
    x_f = (d_cpu["h"].float() + f * FFN_SCALE).bfloat16()
    got["f not rounded"] = fails(lambda: check(
        mo, ops.rms_norm(x_f, d_cpu["next_norm"], EPS), "kernels.residual_norm.moe_tail", "bf16"))
    for key, val in got.items():
        print(f"\n  broken: {key}: {val}")


# --- the twins are reference/model.py's layer ≥ 1 ("bf16-fold") -----------------------------


def test_twins_reproduce_reference_model_bf16_fold():
    """The target forward rebuilt from the twins (attention and experts from the reference)
    gives bit-identical logits and hidden state to ReferenceModel(precision="bf16-fold"): the
    twins round exactly where model.py does. Also shows "bf16-fold" differs from "bf16"."""
    cfg = preset("tiny")
    t = cfg.target
    model = ReferenceModel(cfg, synthetic_params(cfg, 0), "bf16-fold")
    p, eps = model.p, t.rms_norm_eps
    tokens = torch.randint(0, t.vocab_size, (6,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(6)
    want = model.target(tokens, pos)
    n_live = torch.tensor([6], dtype=torch.int32)
    x = p["model.embed_tokens.weight"][tokens]
    xn = None
    for i, kind in enumerate(t.layer_types):
        pre = f"model.layers.{i}."
        window, theta = (None, t.rope_theta) if kind == "full" else (t.sliding_window,
                                                                    t.swa_rope_theta)
        if i == 0:  # layer 0 (not a tail of this module): as model.py
            xn0 = ops.rms_norm(x, p[pre + "attention_norm.weight"], eps)
            a = model._attn(pre, xn0, pos, None, i, window, theta)
            h = (x.float() + ops.rms_norm(a, p[pre + "attn_out_norm.weight"], eps).float())
            h = h.bfloat16()
            f_in = ops.rms_norm(h, p[pre + "feed_forward_norm.weight"], eps)
            f = ops.swiglu(f_in, p[pre + "mlp.gate_proj.weight"], p[pre + "mlp.up_proj.weight"],
                           p[pre + "mlp.down_proj.weight"])
            x = (h.float() + ops.rms_norm(f, p[pre + "ffn_out_norm.weight"], eps).float())
            xn = ops.rms_norm(x.bfloat16(), p["model.layers.1.attention_norm.weight"], eps)
            continue
        a = model._attn(pre, xn, pos, None, i, window, theta)  # bf16 o_proj output
        at = attn_tail_ref(a.float()[None], xn, p[pre + "attn_out_norm.weight"],
                           p[pre + "feed_forward_norm.weight"], n_live, eps=eps,
                           attn_out_scale=t.attn_out_scale,
                           router_w=p[pre + "mlp.router.weight"], top_k=t.num_experts_per_tok)
        f = ops.moe(at.f_in, at.weights, at.ids.long(), p[pre + "mlp.experts.fc"],
                    p[pre + "mlp.experts.proj"])
        last = i == t.num_hidden_layers - 1
        nxt = p["model.norm.weight"] if last else p[f"model.layers.{i + 1}.attention_norm.weight"]
        xn = moe_tail_ref(f.float()[None], at.h, nxt, n_live, eps=eps,
                          ffn_out_scale=t.ffn_out_scale).xn
    logits = ops.linear(xn, p["lm_head.weight"], out_dtype=torch.float32)
    assert torch.equal(xn, want.hidden) and torch.equal(logits, want.logits)
    plain = ReferenceModel(cfg, synthetic_params(cfg, 0), "bf16").target(tokens, pos)
    assert not torch.equal(plain.logits, want.logits), "bf16-fold must differ from bf16 here"


def test_wrapper_errors(device):
    case = CASES[1]
    d = on(make_inputs(case, 5), device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    base = (d["partials"], d["xn"], d["attn_out_norm"], d["ffn_norm"], d["n_live"], flag)
    kw = dict(eps=EPS, attn_out_scale=1.0, max_polls=2)

    def call(*args, **extra):
        return attn_tail(*args, **(kw | extra))

    with pytest.raises(ValueError, match=r"partials: expected 1\.\.8 rows"):
        call(d["partials"].repeat(1, 2, 1), *base[1:])
    with pytest.raises(ValueError, match=r"partials: expected 1\.\.64 partials"):
        call(d["partials"].repeat(33, 1, 1), *base[1:])
    with pytest.raises(ValueError, match="partials: expected dtype"):
        call(d["partials"].half(), *base[1:])
    with pytest.raises(ValueError, match=r"xn: expected shape \(8, 128\)"):
        call(base[0], d["xn"][:, :64], *base[2:])
    with pytest.raises(ValueError, match="xn: expected dtype"):
        call(base[0], d["xn"].float(), *base[2:])
    with pytest.raises(ValueError, match=r"ffn_norm: expected shape \(128,\)"):
        call(*base[:3], d["ffn_norm"][:64], *base[4:])
    with pytest.raises(ValueError, match="n_live: expected dtype"):
        call(*base[:4], d["n_live"].long(), flag)
    with pytest.raises(ValueError, match="fail_flag: expected dtype"):
        call(*base[:5], flag.float())
    with pytest.raises(ValueError, match="max_polls: expected an int"):
        call(*base, max_polls=0)
    with pytest.raises(ValueError, match=r"rearm: expected shape \(8, 128\)"):
        call(*base, rearm=d["xn"][:4].float())
    with pytest.raises(ValueError, match="rearm: overlaps the partials being consumed"):
        call(*base, rearm=d["partials"][1])
    with pytest.raises(ValueError, match=r"router_w: expected contiguous \[E, 128\]"):
        call(*base, router_w=d["router_w"][:, :64], top_k=4)
    with pytest.raises(ValueError, match=r"top_k: expected 1\.\.16"):
        call(*base, router_w=d["router_w"], top_k=0)
    with pytest.raises(ValueError, match="top_k / scratch given without router_w"):
        call(*base, top_k=4)
    with pytest.raises(ValueError, match=r"h: expected shape \(8, 128\)"):
        moe_tail(d["partials"], d["h"][:3], d["next_norm"], d["n_live"], flag, eps=EPS,
                 ffn_out_scale=1.0, max_polls=1)
    with pytest.raises(ValueError, match="moe_release: .* needs pdl=True"):
        moe_tail(d["partials"], d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
                 ffn_out_scale=1.0, max_polls=1, config=TailLaunch(moe_release=True))


@pytest.mark.parametrize("n", [0, 2])
def test_rows_without_rearm_wait_only_for_live_rows(n, device):
    """Without re-arming, padding rows have nothing to wait for: on all-NaN (unwritten) partials
    of the padding rows — and with n = 0, of every row, as in a device round launched after the
    request finished — no padding row polls and no flag is raised (polling row 0 they would wait
    until max_polls and raise the flag whenever row 0 was unwritten). With re-arming and n = 0
    the step is empty too (kernels/readiness.py, "Empty steps"): no poll, no re-arm, no flag — a
    poll of row 0 would time out on a NaN-armed ring and fail graph capture's warm-up; with
    n = 2 the padding rows poll row 0 for the producers' evidence."""
    g = torch.Generator().manual_seed(8)
    rows, hidden, experts = 8, 128, 16
    part = torch.full((2, rows, hidden), float("nan"))
    part[:, :n] = torch.randn(2, n, hidden, generator=g)
    xn = torch.randn(rows, hidden, generator=g).bfloat16()
    w1, w2 = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16(), torch.ones(hidden).bfloat16()
    rw = torch.randn(experts, hidden, generator=g) / hidden**0.5
    dev = lambda t: t.to(device)  # noqa: E731
    n_live = torch.tensor([n], dtype=torch.int32, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    polls = torch.full((rows,), -1, dtype=torch.int32, device=device)
    out = attn_tail(dev(part), dev(xn), dev(w1), dev(w2), n_live, flag, eps=EPS,
                    attn_out_scale=1.0, max_polls=50, router_w=dev(rw), top_k=4, polls=polls)
    assert flag.item() == 0
    assert polls.cpu().tolist() == [1] * n + [0] * (rows - n)
    assert not torch.isnan(out.h.cpu()[:n].float()).any()
    mo_polls = torch.full((rows,), -1, dtype=torch.int32, device=device)
    moe_tail(dev(part), dev(xn), dev(w2), n_live, flag, eps=EPS, ffn_out_scale=1.0,
             max_polls=50, polls=mo_polls)
    assert flag.item() == 0 and mo_polls.cpu().tolist() == [1] * n + [0] * (rows - n)
    rearm = torch.zeros(rows, hidden, device=device)
    moe_tail(dev(part), dev(xn), dev(w2), n_live, flag, eps=EPS, ffn_out_scale=1.0,
             max_polls=50, rearm=rearm, polls=mo_polls)
    assert flag.item() == 0
    assert mo_polls.cpu().tolist() == [0 if n == 0 else 1] * rows  # padding rows poll row 0
    assert (rearm.cpu() == 0).all() if n == 0 else torch.isnan(rearm.cpu()).all()


# --- the compiled (non-interpreter) kernels build for sm_90 ------------------------------------


def _compile_sm90() -> dict[str, dict[str, int]]:
    """Compile both kernels at the real shape for sm_90 (Triton's bundled ptxas, no GPU);
    count the PTX instructions the readiness protocol and the rounding rely on."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.tails as T

    def build(fn, types, consts, warps=8):
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = types.get(name, "*fp32")
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[name] = "fp32" if name in ("eps", "scale") else "i32"
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "enable_fp_fusion": False})
        ptx = k.asm["ptx"]
        keys = ("ld.volatile.global", "atom.global.gpu.acq_rel", "atom.global.gpu.release",
                "ld.global.gpu.acquire", "bar.sync", "fma.rn.f32",
                "sqrt.rn.f32", "div.rn.f32", "ex2.approx", "%globaltimer", "ld.global")
        got = {key: ptx.count(key) for key in keys}
        wait = ptx.find("griddepcontrol.wait")
        release = ptx.find("griddepcontrol.launch_dependents")
        got["release_before_wait"] = int(0 <= release < wait)
        got["pdl_wait"] = int(wait >= 0)
        return got

    bf, i32 = "*bf16", "*i32"
    common = {"xn_ptr": bf, "w_aon_ptr": bf, "w_ffn_ptr": bf, "h_ptr": bf, "f_ptr": bf,
              "polls_ptr": i32, "flag_ptr": i32, "n_live_ptr": i32, "cnt_ptr": i32,
              "ids_ptr": i32, "w_ptr": bf, "x_ptr": bf, "trace_ptr": "*i64", "ready_ptr": i32}
    cfg = T.tail_launch(3072, 256)
    stats = {}
    chunk_ptrs = {"ok_ptr": i32, "arrive_ptr": i32}
    for router, unroll, topk, prefetch, trace, count, k in (  # topk: router.py's TOPK mode
            (True, False, 0, False, False, False, 1), (True, True, 0, False, False, False, 1),
            (True, False, 1, False, False, False, 1), (False, False, 0, False, False, False, 1),
            (True, False, 0, True, False, False, 1), (True, True, 0, True, False, False, 1),
            (True, False, 0, False, True, False, 1), (True, False, 0, False, False, True, 1),
            (True, False, 2, False, False, False, 1), (True, False, 0, False, False, True, 12)):
        parts = "*fp32" if router else bf  # fp32 partials with polls; bf16 partials without
        stats[f"attn_router{router}" + ("_unrolled" if unroll else "")
              + ("", "_packed", "_groups")[topk] + ("_prefetch" if prefetch else "")
              + ("_trace" if trace else "") + ("_chunks" if k > 1 else "")
              + ("_count" if count else "")] = build(
            T._attn_tail_kernel, common | chunk_ptrs | {"part_ptr": parts, "rearm_ptr": parts,
                                                        "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, {
                "HIDDEN": 3072, "BLOCK_H": 4096, "NPART": 8, "REARM": True,
                "WRITE_POLLS": router, "ROUTER": router, "EXPERTS": 256, "BLOCK_EALL": 256,
                "TOP_K": 8, "BLOCK_TOPK": 8, "ROUTE_ROWS": cfg.route_rows,
                "BLOCK_E": cfg.block_e, "BLOCK_K": cfg.block_k, "UNROLL_K": unroll,
                "QUANT": router, "GROUPS": 32, "TABLE": False, "PART_BF16": not router,
                "REARM_PARTS": 1, "TOPK": topk, "PREFETCH_W": prefetch,
                "TRACE": trace, "COUNT_READY": count, "PDL": False,
                "CHUNK": 4096 if k == 1 else 256, "K": k, "KP": pow2(k)},
            cfg.num_warps)
    for quant, trace, k, release in ((False, False, 1, False), (True, False, 1, False),
                                     (True, True, 1, False), (True, False, 6, False),
                                     (True, False, 6, True)):
        table = {"part_ptr": "*i64"} if quant else {}  # the quantizing tail reads via a table
        stats["moe" + ("_quant" if quant else "") + ("_trace" if trace else "")
              + ("_chunks" if k > 1 else "") + ("_release" if release else "")] = build(
            T._moe_tail_kernel,
            common | {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"} | table | chunk_ptrs, {
                "HIDDEN": 3072, "BLOCK_H": 4096, "NPART": 8, "REARM": True,
                "WRITE_POLLS": False, "WRITE_X": True, "QUANT": quant, "GROUPS": 32,
                "TABLE": quant, "PART_BF16": False, "REARM_PARTS": 1 + quant,
                "CHUNK": 4096 if k == 1 else 512, "K": k, "KP": pow2(k), "TRACE": trace,
                "RELEASE": release, "PDL": release},
            cfg.num_warps)
    return stats


@pytest.mark.slow
def test_compiled_kernels_build_for_sm90():
    """Under TRITON_INTERPRET the kernels are not compilable, hence a fresh process. The polls
    must be volatile loads, the router handoff an acq_rel atomic after a barrier, the norms use
    IEEE sqrt/div, and no FMA may contract the residual adds."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    print(stats)
    for name, s in stats.items():
        assert s["ld.volatile.global"] > 0 and s["fma.rn.f32"] == 0, (name, s)
        assert s["sqrt.rn.f32"] > 0 and s["div.rn.f32"] > 0, (name, s)
    assert stats["attn_routerTrue"]["atom.global.gpu.acq_rel"] == 1
    assert stats["attn_routerTrue_unrolled"]["atom.global.gpu.acq_rel"] == 1
    # the flag reaches the kernel: its poll is unrolled over the 24 chunks of H = 3072
    assert (stats["attn_routerTrue_unrolled"]["ld.volatile.global"]
            > stats["attn_routerTrue"]["ld.volatile.global"])
    assert stats["attn_routerFalse"]["atom.global.gpu.acq_rel"] == 0
    # the chunked MoE tail (kernels/row_chunks.py): one acq_rel arrival per program after its
    # stores (and a barrier); one program per row: none
    assert stats["moe_quant_chunks"]["atom.global.gpu.acq_rel"] == 1
    assert stats["moe_quant_chunks"]["bar.sync"] > stats["moe_quant"]["bar.sync"]
    assert stats["moe_quant"]["atom.global.gpu.acq_rel"] == 0
    # TailLaunch.moe_release (with PDL): the next launch released before this one's wait; the
    # others neither wait (no PDL here) nor release
    assert stats["moe_quant_chunks_release"]["release_before_wait"] == 1
    assert stats["moe_quant_chunks_release"]["pdl_wait"] == 1
    assert all(not s["pdl_wait"] for n, s in stats.items() if n != "moe_quant_chunks_release")
    # the quantizing MoE tail divides more: each group's scale and each value by it (IEEE)
    assert stats["moe_quant"]["div.rn.f32"] > stats["moe"]["div.rn.f32"]
    # timestamps only when traced: start + 3 per row program, 3 per router program
    assert all(s["%globaltimer"] == 0 for name, s in stats.items() if "trace" not in name)
    assert stats["attn_routerTrue_trace"]["%globaltimer"] >= 7
    assert stats["moe_quant_trace"]["%globaltimer"] >= 4
    # prefetched router weights: the same volatile polls, the same single arrival; the weight
    # loads leave the chunk loop, which is unrolled (3 chunks of 1024 at H 3072)
    pre, base = stats["attn_routerTrue_prefetch"], stats["attn_routerTrue"]
    assert pre["atom.global.gpu.acq_rel"] == 1
    assert pre["ld.global"] > base["ld.global"]
    # with the unrolled poll too: the same polls, one arrival
    pre_u, base_u = stats["attn_routerTrue_unrolled_prefetch"], stats["attn_routerTrue_unrolled"]
    assert pre_u["ld.volatile.global"] == base_u["ld.volatile.global"]
    assert pre_u["atom.global.gpu.acq_rel"] == 1
    # the ready counter: one release increment (row programs), one acquire read after the
    # spin (router programs), the same single arrival; without it neither
    cnt = stats["attn_routerTrue_count"]
    assert (cnt["atom.global.gpu.release"], cnt["ld.global.gpu.acquire"],
            cnt["atom.global.gpu.acq_rel"]) == (1, 1, 1), cnt
    assert all(s["atom.global.gpu.release"] == s["ld.global.gpu.acquire"] == 0
               for name, s in stats.items() if not name.endswith("_count"))
    # row chunks (kernels/row_chunks.py): one more acq_rel arrival (the chunks'), and the ready
    # counter raised by a row's last arrival or by a padding row's chunk 0
    ch = stats["attn_routerTrue_chunks_count"]
    assert (ch["atom.global.gpu.release"], ch["ld.global.gpu.acquire"],
            ch["atom.global.gpu.acq_rel"]) == (2, 1, 2), ch
    # the group finish: the same softmax exps and single arrival, fewer barriers (each row's
    # reductions stay inside one warp)
    grp = stats["attn_routerTrue_groups"]
    assert grp["atom.global.gpu.acq_rel"] == 1 and grp["ex2.approx"] == base["ex2.approx"]
    assert grp["bar.sync"] < base["bar.sync"], (grp["bar.sync"], base["bar.sync"])

if __name__ == "__main__":
    print(json.dumps(_compile_sm90()))

