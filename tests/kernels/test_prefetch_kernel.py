"""kernels/prefetch.py against its twin reference.twins.prefetch.prefetch_experts_ref: predicted ids
and score partials bit for bit, warm loads that read exactly the predicted experts' gate/up and
scale bytes (the sink's byte sums), gating by the device live count, and no write outside the
prefetch's own buffers.

Poison: padding rows of hidden hold ±3e38-scale values (bf16-exact) that would dominate every
score if read; output buffers start as NaN (partials) and −7 (ids, sink) and must keep that
wherever the kernels may not write.

Dimension letters: R buffer rows, n live rows, H hidden, E experts, I expert intermediate,
M predicted experts, J score chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from iquestrt.capture import graph_capture
from kernels.fp8 import E4M3
from kernels.prefetch import PrefetchBuffers, prefetch_experts, prefetch_launch
from reference.twins.prefetch import (
    aggregate_ref,
    prefetch_experts_ref,
    score_partials_ref,
    scores_ref,
)
from tests.kernels.sm90 import compile_sm90

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter (tests/conftest.py)
BIG = 2.0**120  # exact in bf16; a padding row of this size swamps every live score


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    hidden: int
    experts: int
    inter: int
    m: int


CASES = [
    Case("mini-like", 8, 128, 24, 64, 8),
    Case("two-chunks-odd-E", 8, 200, 20, 48, 5),  # J = 2, last chunk partial; 2I = 96: 3 tiles
    Case("m-equals-E", 5, 64, 12, 64, 12),
]


def inputs(c: Case, seed: int, p_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c.rows, c.hidden, generator=g).bfloat16()  # [R, H]
    p = (torch.randn(c.hidden, c.experts, generator=g) / c.hidden**0.5).to(p_dtype)  # [H, E]
    codes = torch.randint(0, 256, (c.experts, 2 * c.inter, c.hidden), generator=g,
                          dtype=torch.int32).to(torch.uint8)
    fc = codes.view(E4M3)  # [E, 2I, H]; any byte pattern, NaN codes included: only bytes count
    fc_s = torch.rand(c.experts, -(-2 * c.inter // 128), -(-c.hidden // 128), generator=g)
    return x, p, fc, fc_s


def poisoned_buffers(c: Case) -> PrefetchBuffers:
    b = PrefetchBuffers.create(c.rows, c.hidden, c.experts, 2 * c.inter, c.m, DEV)
    b.partials.fill_(float("nan"))
    b.ids.fill_(-7)
    b.sink.fill_(-7)
    return b


def poison_padding(x: torch.Tensor, n: int) -> None:
    sign = torch.where(torch.arange(x.shape[1]) % 2 == 0, 1.0, -1.0)
    x[n:] = (BIG * sign).bfloat16()


def checksum(fc, fc_s, ids, block_n: int) -> torch.Tensor:
    """[M, tiles] int32: per predicted expert, the byte sums of its fc row tiles (+ its scale
    bytes in tile 0): what the warm programs must have read."""
    out = []
    for e in ids.tolist():
        w = fc[e].view(torch.uint8).to(torch.int64)  # [2I, H]
        sums = [t.sum() for t in w.split(block_n)]
        sums[0] = sums[0] + fc_s[e].contiguous().view(torch.uint8).to(torch.int64).sum()
        out.append(torch.stack(sums))
    return torch.stack(out).to(torch.int32)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).clone()


def run(c: Case, x, p, fc, fc_s, n: int, min_rows=4, max_rows=5):
    """Inputs and buffers on DEV; returns the buffers' host copy."""
    buf = poisoned_buffers(c)
    before = [bits(t) for t in (x, p, fc, fc_s)]
    on = [t.to(DEV) for t in (x, p, fc, fc_s)]
    n_live = torch.tensor([n], dtype=torch.int32, device=DEV)
    out = prefetch_experts(on[0], n_live, on[1], on[2], on[3], c.m, min_rows, max_rows,
                           buffers=buf)
    assert out is buf
    for name, t, b in zip(("hidden", "p", "fc", "fc_s"), on, before, strict=True):
        assert torch.equal(bits(t.cpu()), b), f"the prefetch wrote into its input {name}"
    assert int(n_live) == n, "the prefetch wrote into n_live"
    return PrefetchBuffers(buf.partials.cpu(), buf.ids.cpu(), buf.sink.cpu())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("n", [4, 5])
@pytest.mark.slow
def test_ids_and_partials_equal_twin(case, n):
    x, p, fc, fc_s = inputs(case, 10 + n)
    poison_padding(x, n)
    buf = run(case, x, p, fc, fc_s, n)
    want = prefetch_experts_ref(x, n, p, case.m, 4, 5)
    assert torch.equal(buf.ids, want), f"ids {buf.ids.tolist()} != twin {want.tolist()}"
    assert torch.equal(buf.partials[:, :n], score_partials_ref(x[:n], p)), "partials differ"
    assert torch.isnan(buf.partials[:, n:]).all(), "padding rows of partials written"
    block_n = prefetch_launch(case.experts).warm_block_n
    assert torch.equal(buf.sink, checksum(fc, fc_s, want, block_n)), "warm read other bytes"
    # the checks can fail: the poisoned padding rows would change the prediction if read, and
    # another expert set has another checksum
    if n < case.rows:
        read_all = aggregate_ref(scores_ref(x, p)).argsort(descending=True, stable=True)
        assert not torch.equal(read_all[: case.m].to(torch.int32), want), "poison not effective"
    other = (want + 1) % case.experts
    assert not torch.equal(checksum(fc, fc_s, other, block_n), buf.sink)


def test_fp32_predictor_equals_twin():
    case = CASES[1]
    x, p, fc, fc_s = inputs(case, 3, torch.float32)
    buf = run(case, x, p, fc, fc_s, 5)
    assert torch.equal(buf.ids, prefetch_experts_ref(x, 5, p, case.m, 4, 5))
    assert torch.equal(buf.partials[:, :5], score_partials_ref(x[:5], p))


@pytest.mark.parametrize("n", [0, 1, 3, 6, 8])
def test_gated_off_writes_nothing(n):
    case = CASES[0]
    x, p, fc, fc_s = inputs(case, 20)
    buf = run(case, x, p, fc, fc_s, n)
    assert prefetch_experts_ref(x, n, p, case.m, 4, 5) is None
    assert torch.isnan(buf.partials).all() and (buf.ids == -7).all() and (buf.sink == -7).all()


@pytest.mark.slow
def test_gate_bounds_and_clamp():
    """min_rows = max_rows = 3 launches at n = 3 only; n beyond the buffer clamps to R."""
    case = CASES[2]  # R = 5
    x, p, fc, fc_s = inputs(case, 30)
    buf = run(case, x, p, fc, fc_s, 3, min_rows=3, max_rows=3)
    assert torch.equal(buf.ids, prefetch_experts_ref(x, 3, p, case.m, 3, 3))
    buf = run(case, x, p, fc, fc_s, 4, min_rows=3, max_rows=3)
    assert (buf.ids == -7).all()
    buf = run(case, x, p, fc, fc_s, 50)  # clamps to 5 rows: inside [4, 5]
    assert torch.equal(buf.ids, prefetch_experts_ref(x, 50, p, case.m, 4, 5))


def test_ties_go_to_the_lower_index():
    """Exact ties: columns 3, 9 and 17 of P equal and dominant. A twin that breaks ties the
    other way gives other ids, so the comparison sees tie order."""
    case = CASES[0]
    x, p, fc, fc_s = inputs(case, 40)
    x[:5] = x[:5].abs()
    dominant = p[:, 3].abs() * 4
    for e in (3, 9, 17):
        p[:, e] = dominant
    buf = run(case, x, p, fc, fc_s, 5)
    want = prefetch_experts_ref(x, 5, p, case.m, 4, 5)
    assert want[:3].tolist() == [3, 9, 17]
    assert torch.equal(buf.ids, want)
    agg = aggregate_ref(scores_ref(x[:5], p))
    flipped = case.experts - 1 - agg.flip(0).argsort(descending=True, stable=True)[: case.m]
    assert not torch.equal(flipped.to(torch.int32), buf.ids), "tie order not observed"


def test_nan_scores_rank_last():
    case = CASES[0]
    x, p, fc, fc_s = inputs(case, 50)
    p[7, 2] = float("nan")  # expert 2's score is NaN for every row
    p[:, 5] = p[:, 5].abs() * 10  # positive, to make the NaN visible had it ranked first
    x[:4] = x[:4].abs()
    buf = run(case, x, p, fc, fc_s, 4)
    want = prefetch_experts_ref(x, 4, p, case.m, 4, 5)
    assert torch.equal(buf.ids, want) and 2 not in want.tolist() and want[0] == 5


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.zeros(8, 128)), "hidden: expected dtype"),
    (dict(p=torch.zeros(127, 24, dtype=torch.bfloat16)), "p: expected contiguous"),
    (dict(fc_s=torch.zeros(24, 2, 1)), "fc_s: expected shape"),
    (dict(m=0), "m: expected an int in"),
    (dict(m=25), "m: expected an int in"),
    (dict(min_rows=5, max_rows=4), "min_rows, max_rows"),
    (dict(n_live=torch.tensor([4])), "n_live: expected dtype"),
])
def test_bad_input_named(bad, match):
    case = CASES[0]
    x, p, fc, fc_s = inputs(case, 60)
    args = dict(x=x, n_live=torch.tensor([4], dtype=torch.int32), p=p, fc=fc, fc_s=fc_s, m=8,
                min_rows=4, max_rows=5) | bad
    with pytest.raises(ValueError, match=match):
        prefetch_experts(args["x"], args["n_live"], args["p"], args["fc"], args["fc_s"],
                         args["m"], args["min_rows"], args["max_rows"])


SM90_COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import prefetch as k

def build(fn, sig, const, opts):
    full = {n: "constexpr" if n in const else sig.get(n, "i32") for n in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, full, constexprs=const),
                         target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    return {t: len(re.findall(t, ptx)) for t in ("fma.rn.f32", "evict_last", "ld.global")}

cfg = k.prefetch_launch(256)
no_fma = dict(num_warps=cfg.num_warps, enable_fp_fusion=False)
print(json.dumps({
    "scores": build(k._prefetch_scores_kernel,
        dict(x_ptr="*bf16", p_ptr="*bf16", n_live_ptr="*i32", part_ptr="*fp32"),
        dict(CHUNK=128, BLOCK_R=8, BLOCK_E=cfg.block_e, PDL=False), no_fma),
    "scores_fused": build(k._prefetch_scores_kernel,  # the broken variant: contraction on
        dict(x_ptr="*bf16", p_ptr="*bf16", n_live_ptr="*i32", part_ptr="*fp32"),
        dict(CHUNK=128, BLOCK_R=8, BLOCK_E=cfg.block_e, PDL=False),
        dict(num_warps=cfg.num_warps)),
    "select": build(k._prefetch_select_kernel,
        dict(part_ptr="*fp32", n_live_ptr="*i32", ids_ptr="*i32"),
        dict(R=8, J=24, M=16, BLOCK_EALL=256, PDL=False), no_fma),
    "warm": build(k._prefetch_warm_kernel,
        dict(ids_ptr="*i32", n_live_ptr="*i32", fc_ptr="*u8", fcs_ptr="*u8", sink_ptr="*i32"),
        dict(H=3072, SB=288, BLOCK_N=cfg.warm_block_n, BLOCK_K=cfg.warm_block_k,
             BLOCK_S=cfg.scale_block, PDL=False), dict(num_warps=cfg.num_warps)),
}))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """Without a GPU: the kernels build for sm_90 at the TP8 shapes (H 3072, E 256, 2I 384, J 24,
    M 16); the scores kernel has no FMA (its sums must stay the twin's), the warm loads carry
    the evict_last hint (ptxas rejects it combined with .cg, so the loads keep the default .ca)."""
    got = compile_sm90(SM90_COMPILE)
    print(f"\n  sm_90 PTX: {got}")
    assert got["scores"]["fma.rn.f32"] == 0 and got["select"]["fma.rn.f32"] == 0
    assert got["scores_fused"]["fma.rn.f32"] > 0, "the FMA count cannot see contraction"
    assert got["warm"]["evict_last"] > 0


# --- GPU only: per-rank TP8 shapes inside a CUDA graph --------------------------------------


@pytest.mark.gpu
def test_tp8_graph_replay_matches_twin(device):
    """H 3072, E 256, 2I 384, M 16, R 8: one captured graph serves n = 4, 5 (ids = twin) and
    n = 6 (nothing written), n set on the device between replays."""
    case = Case("tp8", 8, 3072, 256, 192, 16)
    x, p, fc, fc_s = inputs(case, 70)
    xd, pd, fcd, fsd = (t.to(device) for t in (x, p, fc, fc_s))
    n_live = torch.tensor([4], dtype=torch.int32, device=device)
    buf = PrefetchBuffers.create(case.rows, case.hidden, case.experts, 2 * case.inter, case.m,
                                 device)
    prefetch_experts(xd, n_live, pd, fcd, fsd, case.m, 4, 5, buffers=buf)  # compile first
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        prefetch_experts(xd, n_live, pd, fcd, fsd, case.m, 4, 5, buffers=buf)
    block_n = prefetch_launch(case.experts).warm_block_n
    for n in (4, 5, 6):
        buf.ids.fill_(-7)
        n_live.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        want = prefetch_experts_ref(x, n, p, case.m, 4, 5)
        if want is None:
            assert (buf.ids.cpu() == -7).all()
            continue
        assert torch.equal(buf.ids.cpu(), want)
        assert torch.equal(buf.partials.cpu()[:, :n], score_partials_ref(x[:n], p))
        assert torch.equal(buf.sink.cpu(), checksum(fc, fc_s, want, block_n))
