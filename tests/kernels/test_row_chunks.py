"""The tails' rows in column-chunk programs (TailLaunch.moe_chunk_groups / attn_chunk_groups,
kernels/row_chunks.py): every chunk size gives the bits of one program per row — the MoE tail's
xn', x and quantized operand; the attention tail's h, f_in, its quantized operand and the folded
router's ids and weights (ready counter or NaN readiness); the re-armed slot, the polls, the
failure flag and the NaN rows of a timeout — with the arrival counters back at 0 after every
launch; bad configurations are refused. Inputs and cases: tests/kernels/test_tails.py.

Dimension letters: N partials, R rows, n live rows, H hidden, K chunks per row.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from kernels.row_chunks import RowChunkScratch
from kernels.tails import RouterScratch, attn_tail, moe_tail, tail_launch
from kernels.tails_launch import TailLaunch, chunk_grid
from qualification.tolerances import check
from reference.op_types import MoeTailOut
from reference.twins.tails import moe_tail_ref
from tests.kernels.test_tails import (
    CASES,
    EPS,
    FFN_SCALE,
    POISON,
    REAL,
    Case,
    assert_quantized,
    make_inputs,
    nan_launch,
    on,
    poisoned_attn_out,
    poisoned_quant,
)

# (case, 128-column groups per chunk of each launch compared): K = ⌈H / (128·g)⌉ per row
CHUNKED = (
    (CASES[5], (1,)),  # H 200: K 2, the second chunk mostly masked; strided, R 7
    (CASES[6], (1, 4)),  # H 1024: K 8 and 2
    (Case("gauss-5of8-N3-1024", 3, 8, 5, 1024, grid=False), (2, 1, 4)),  # K 4, 8, 2
    (Case("bf16-8of8-N2-640", 2, 8, 8, 640, part_dtype=torch.bfloat16), (1, 2)),  # K 5, 3
)


def _run(case: Case, d: dict, device, groups: int, scratch=None, rearm=None, max_polls=2):
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    r, h = case.rows, case.hidden
    full = lambda dt: torch.full((r, h), POISON, dtype=dt, device=device)  # noqa: E731
    out = MoeTailOut(full(torch.bfloat16), full(torch.bfloat16))
    out.xq, out.sx = poisoned_quant(r, h, device)
    cfg = replace(tail_launch(h), moe_chunk_groups=groups)
    moe_tail(d["partials"], d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
             ffn_out_scale=FFN_SCALE, max_polls=max_polls, rearm=rearm, out=out, config=cfg,
             quantize=True, chunk_scratch=scratch)
    return out, flag


def _bits(out) -> dict[str, torch.Tensor]:
    """Every output tensor of a MoeTailOut / AttnTailOut as raw bits."""
    got = {}
    for k, v in vars(out).items():
        if v is not None:
            got[k] = v.cpu().view(torch.uint8) if v.element_size() == 1 else v.cpu().view(
                {2: torch.int16, 4: torch.int32}[v.element_size()])
    return got


def _same(a, b) -> None:
    ba, bb = _bits(a), _bits(b)
    for k in ba:
        assert torch.equal(ba[k], bb[k]), k


@pytest.mark.parametrize("case,sizes", CHUNKED, ids=lambda v: getattr(v, "name", str(v)))
def test_chunk_sizes_give_the_same_bits(case, sizes, device):
    """Every chunk size: the output bits of one program per row (padding rows untouched), x
    exactly the twin's, xn' within the moe_tail row of the twin, the quantized operand exactly
    quantize_act(xn'); the counters back at 0; a second launch on the same scratch gives the
    same bits again."""
    d_cpu = make_inputs(case, 210 + len(sizes))
    d = on(d_cpu, device, case.strided)
    n = case.n_live
    twin = moe_tail_ref(d_cpu["partials"], d_cpu["h"], d_cpu["next_norm"], d_cpu["n_live"],
                        eps=EPS, ffn_out_scale=FFN_SCALE)
    whole, flag0 = _run(case, d, device, 0)
    assert flag0.item() == 0
    scratch = RowChunkScratch.create(device)
    for groups in sizes:
        cfg = replace(tail_launch(case.hidden), moe_chunk_groups=groups)
        k = chunk_grid(cfg.moe_chunk_groups, case.hidden)[1]
        assert k == -(-case.hidden // (128 * groups)) >= 2
        for _ in range(2):
            got, flag = _run(case, d, device, groups, scratch)
            assert flag.item() == 0
            assert (scratch.arrive.cpu() == 0).all()
            _same(got, whole)
    assert torch.equal(got.x.cpu()[:n].view(torch.int16), twin.x.view(torch.int16))
    check(got.xn.cpu()[:n], twin.xn, "kernels.residual_norm.moe_tail", "bf16")
    assert (got.xn.cpu()[n:].float() == POISON).all()
    assert_quantized(got.xq, got.sx, got.xn, n, "chunked xq")


def test_timeout_of_one_chunk_fails_its_row_like_the_row_program(device):
    """A live row whose partials stay NaN in one chunk only: the flag, the whole row NaN (xn'
    and x), the other rows as without the fault — the bits of one program per row for two
    chunk sizes — and the counters at 0 (the failed chunk still arrives)."""
    case = CASES[6]  # H 1024, 6 of 8 live
    d_cpu = make_inputs(case, 230)
    d_cpu["partials"][1, 2, 300:310] = float("nan")  # row 2, inside chunk 2 of 8
    d = on(d_cpu, device)
    whole, flag0 = _run(case, d, device, 0)
    clean, _ = _run(case, on(make_inputs(case, 230), device), device, 2)
    scratch = RowChunkScratch.create(device)
    got, flag = _run(case, d, device, 1, scratch)
    other, flag2 = _run(case, d, device, 2, scratch)
    assert flag.item() == flag2.item() == flag0.item() == 1
    _same(got, whole)
    _same(other, whole)
    for t in (got, whole):
        assert torch.isnan(t.xn.cpu()[2].float()).all() and torch.isnan(t.x.cpu()[2].float()).all()
    ok = [0, 1, 3, 4, 5]
    assert torch.equal(got.xn.cpu()[ok].view(torch.int16), clean.xn.cpu()[ok].view(torch.int16))
    assert (scratch.arrive.cpu() == 0).all()


def test_chunks_rearm_the_whole_slot_row(device):
    """With a re-arm target ([S, R, H], another slot) every column of every row is set to NaN
    — padding rows too (kernels/readiness.py (4)) — whatever the chunk size."""
    case = CASES[6]
    d = on(make_inputs(case, 240), device)
    slots = {}
    for groups in (0, 2):
        rearm = torch.zeros(2, case.rows, case.hidden, device=device)
        out, flag = _run(case, d, device, groups, RowChunkScratch.create(device), rearm=rearm)
        assert flag.item() == 0
        slots[groups] = (rearm.cpu(), out)
    assert torch.isnan(slots[0][0]).all() and torch.isnan(slots[2][0]).all()
    _same(slots[2][1], slots[0][1])


def test_chunk_configuration_errors(device):
    with pytest.raises(ValueError, match="moe_chunk_groups: 0 or a power of two"):
        TailLaunch(moe_chunk_groups=3)
    with pytest.raises(ValueError, match="moe_chunk_groups: 0 or a power of two"):
        TailLaunch(moe_chunk_groups=-1)
    case = Case("wide", 1, 2, 2, 128 * 33)
    d = on(make_inputs(case, 250), device)
    with pytest.raises(ValueError, match="33 chunks .* at most 32 chunks"):
        _run(case, d, device, 1)
    bad = RowChunkScratch.create(device)
    bad = RowChunkScratch(bad.arrive[:8], bad.ok)
    case = CASES[6]
    d = on(make_inputs(case, 251), device)
    with pytest.raises(ValueError, match="scratch.arrive"):
        _run(case, d, device, 1, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("n_live", [1, 6, 8])
def test_real_shape_chunks_in_graph_replays_gpu(n_live, device):
    """H 3072 in 12 chunks of 256 (the pin), 6 of 512 and 24 of 128 at 1, 6, 8 live rows: the
    bits of one program per row over 20 CUDA graph replays each on one scratch, counters at 0
    after them."""
    case = replace(REAL, n_live=n_live, experts=0, top_k=0)
    d = on(make_inputs(case, 260 + n_live), device)
    whole, _ = _run(case, d, device, 0)
    for groups in (2, 4, 1):
        scratch = RowChunkScratch.create(device)
        _run(case, d, device, groups, scratch)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got, flag = _run(case, d, device, groups, scratch)
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        assert flag.item() == 0
        _same(got, whole)
        assert (scratch.arrive.cpu() == 0).all()


# --- the attention tail --------------------------------------------------------------------------

ATTN_CHUNKED = (
    (CASES[6], (1, 4)),  # H 1024, 64 experts, top-8: K 8 and 2
    (CASES[5], (1,)),  # H 200, 24 experts, top-3, strided, R 7: K 2
    (replace(CASES[6], name="medium-noroute", experts=0, top_k=0), (2,)),  # no router: K 4
    (Case("gauss-6of8-N3-512", 3, 8, 6, 512, 16, 4, grid=False), (1,)),  # sums off the bf16 grid
)


def _run_attn(case: Case, d: dict, device, config, scratch=None, rearm_fill=5.0):
    """→ (out, router scratch, flag, polls, rearm) of one attention-tail launch."""
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    polls = torch.zeros(case.rows, dtype=torch.int32, device=device)
    rearm = torch.full((case.rows, case.hidden), rearm_fill, dtype=case.part_dtype,
                       device=device)
    rs = RouterScratch.create(case.hidden, case.experts, device) if case.experts else None
    out = attn_tail(d["partials"], d["xn"], d["attn_out_norm"], d["ffn_norm"], d["n_live"], flag,
                    eps=EPS, attn_out_scale=case.scale, max_polls=4, rearm=rearm,
                    router_w=d.get("router_w"), top_k=case.top_k, scratch=rs,
                    out=poisoned_attn_out(case, device), polls=polls, config=config,
                    quantize=True, chunk_scratch=scratch)
    return out, rs, flag, polls, rearm


@pytest.mark.parametrize("count", [True, False], ids=["counter", "nan"])
@pytest.mark.parametrize("case,sizes", ATTN_CHUNKED, ids=lambda v: getattr(v, "name", str(v)))
def test_attention_chunks_give_the_row_programs_bits(case, sizes, count, device):
    """Every chunk size, with the router waiting on the ready counter (pinned) or on r_in's
    NaN: h, f_in, fq / sf, ids, weights, the router input, the polls and the re-armed slot of
    one program per row; counters back at 0 (the router's too)."""
    d = on(make_inputs(case, 280 + len(sizes)), device, case.strided)
    base = tail_launch(case.hidden, case.experts) if count else nan_launch(case)
    whole, rs0, flag0, polls0, rearm0 = _run_attn(case, d, device, base)
    assert flag0.item() == 0
    scratch = RowChunkScratch.create(device)
    for groups in sizes:
        cfg = replace(base, attn_chunk_groups=groups)
        assert chunk_grid(groups, case.hidden)[1] >= 2
        for _ in range(2):
            got, rs, flag, polls, rearm = _run_attn(case, d, device, cfg, scratch)
            assert flag.item() == 0
            _same(got, whole)
            assert torch.equal(polls.cpu(), polls0.cpu())
            assert torch.isnan(rearm.cpu()).all() and torch.isnan(rearm0.cpu()).all()
            assert (scratch.arrive.cpu() == 0).all()
            if case.experts:
                n = case.n_live
                assert torch.equal(rs.r_in.cpu()[:n].view(torch.int32),
                                   rs0.r_in.cpu()[:n].view(torch.int32))
                assert rs.counter.item() == 0 and rs.ready.item() == 0


def test_attention_chunk_timeout_fails_its_row(device):
    """One chunk of a live row never ready: the flag, that row's h / f_in NaN and ids −1, the
    other rows routed — one program per row's bits — and every counter back at 0."""
    case = CASES[6]
    d_cpu = make_inputs(case, 290)
    d_cpu["partials"][2, 4, 700:705] = float("nan")  # row 4, chunk 5 of 8
    d = on(d_cpu, device)
    base = tail_launch(case.hidden, case.experts)
    whole, rs0, flag0, _, _ = _run_attn(case, d, device, base)
    scratch = RowChunkScratch.create(device)
    got, rs, flag, _, _ = _run_attn(case, d, device, replace(base, attn_chunk_groups=1), scratch)
    assert flag.item() == flag0.item() == 1
    _same(got, whole)
    assert torch.isnan(got.h.cpu()[4].float()).all() and (got.ids.cpu()[4] == -1).all()
    # a failed row's router input is +inf (not NaN: the router must not wait for it)
    assert torch.isinf(rs.r_in.cpu()[4]).all() and torch.isinf(rs0.r_in.cpu()[4]).all()
    assert (got.ids.cpu()[[0, 1, 2, 3, 5]] >= 0).all()
    assert (scratch.arrive.cpu() == 0).all() and rs.counter.item() == 0 and rs.ready.item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("n_live", [1, 6])
def test_real_shape_attention_chunks_in_graph_replays_gpu(n_live, device):
    """H 3072, 256 experts, top-8, pinned router: chunks of 256 / 512 give the row programs'
    bits over 20 CUDA graph replays, every counter at 0 after them."""
    case = replace(REAL, n_live=n_live)
    d = on(make_inputs(case, 300 + n_live), device)
    base = tail_launch(case.hidden, case.experts)
    whole, *_ = _run_attn(case, d, device, base)
    for groups in (2, 4):
        cfg = replace(base, attn_chunk_groups=groups)
        scratch = RowChunkScratch.create(device)
        rs = RouterScratch.create(case.hidden, case.experts, device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        out = poisoned_attn_out(case, device)
        call = partial(attn_tail, d["partials"], d["xn"], d["attn_out_norm"], d["ffn_norm"],
                       d["n_live"], flag, eps=EPS, attn_out_scale=case.scale, max_polls=4,
                       router_w=d["router_w"], top_k=case.top_k, scratch=rs, out=out,
                       config=cfg, quantize=True, chunk_scratch=scratch)
        call()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        assert flag.item() == 0
        _same(out, whole)
        assert (scratch.arrive.cpu() == 0).all() and rs.counter.item() == 0
