"""kernels/sampler/ against two oracles:
  (a) a scalar numpy-fp32 replay of reference/sampling.py's pinned semantics taking exp from
      kernels.sampler.kernel_exp (the exp the kernel runs): ids, order, probabilities and tokens
      bit-exact (row kernels.sampler.ids / kernels.sampler.token);
  (b) the twin reference.twins.sampler.sample_ref (torch.exp): probabilities within
      kernels.sampler.probs, ids and tokens exact wherever every decision of the row (orders,
      the top-p crossing, the draw's CDF interval) is farther from its threshold than
      decision_margin(K); nearer rows are counted and reported, never chosen away.
Also: sharded == unsharded bit for bit (N = 2, 4, 8, unequal shards, ties across shard
boundaries), the TP path (topk_candidates + sample_from_candidates), the RNG counters, padding
rows, the sm_90 build, broken variants, wrapper errors; GPU-only real shapes, CUDA graphs and
the benchmark.

Dimension letters: R rows, V vocabulary, K = top_k, W output width.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from iquestrt.capture import graph_capture
from kernels.sampler import (
    MAX_TOP_K,
    SampleOut,
    SamplerLaunch,
    kernel_exp,
    sample,
    sample_from_candidates,
    topk_candidates,
)
from qualification.tolerances import check, tolerance
from reference.config import SamplingDefaults as SP
from reference.ops import exp32
from reference.rng import Purpose, uniforms
from reference.twins.sampler import sample_ref
from tests.reference.test_sampling import _drop_crossing_token, served_f64

F32 = np.float32
POISON_ID = -7


# --- the scalar replay ---------------------------------------------------------------------
@dataclass
class Replay:
    ids: list[int]
    probs: list[np.float32]
    token: int
    margin: float  # distance of the nearest exp-sensitive decision to its threshold


def torch_exp(v: np.ndarray) -> np.ndarray:
    """The twin's exp (reference.ops.exp32: FP64 exp rounded to FP32)."""
    return exp32(torch.from_numpy(v)).numpy()


def device_exp(device):
    return lambda v: kernel_exp(torch.from_numpy(v).to(device)).cpu().numpy()


def seq(vals) -> list[np.float32]:
    c, out = F32(0), []
    for v in vals:
        c = F32(c + v)
        out.append(c)
    return out


def replay(x: torch.Tensor, params: SP, u: np.float32, exp) -> Replay:
    """reference/sampling.py's semantics for one row [V] on numpy float32 scalars. margin: the
    nearest exp-sensitive decision — the relative gap of two adjacent positive values of
    distinct logits (an order flip), |c_j − top_p| (the top-p cut), |fl(u·Z) − c_i| (the draw);
    a p that underflowed from a positive e counts as margin 0."""
    xs = x.detach().cpu().numpy().astype(F32)
    V = len(xs)
    if params.temperature == 0:
        i = min(range(V), key=lambda i: (-float(xs[i]), i))
        return Replay([i], [F32(1)], i, math.inf)
    z = xs / F32(params.temperature)
    order = sorted(range(V), key=lambda i: (-float(z[i]), i))[: params.top_k]
    zk = np.array([z[i] for i in order], dtype=F32)
    e = dict(zip(order, exp(zk - zk[0]), strict=True))
    s = seq(e[i] for i in order)[-1]
    pr = {i: F32(e[i] / s) for i in order}
    porder = sorted(order, key=lambda i: (-float(pr[i]), i))
    cs = seq(pr[i] for i in porder)
    margins = [math.inf] + [0.0 for i in order if pr[i] == 0 and e[i] > 0]
    first = None
    if params.top_p < 1:
        margins += [abs(float(c) - float(F32(params.top_p))) for c in cs]
        first = next((j for j, c in enumerate(cs) if c >= F32(params.top_p)), None)
    kept = porder if first is None else porder[: first + 1]
    s2 = seq(pr[i] for i in kept)[-1]
    served = {i: F32(pr[i] / s2) if i in kept else F32(0) for i in order}
    final = sorted(order, key=lambda i: (-float(served[i]), i))
    for vals, ordr in ((pr, porder), (served, final)):
        margins += [float((vals[a] - vals[b]) / vals[a])
                    for a, b in zip(ordr[:-1], ordr[1:], strict=True)
                    if vals[b] > 0 and z[a] != z[b]]
    sup = [i for i in final if served[i] > 0]
    c = seq(served[i] for i in sup)
    t = F32(u * c[-1])
    margins += [abs(float(t) - float(ci)) for ci in c]
    token = next((i for i, ci in zip(sup, c, strict=True) if t < ci), sup[-1])
    return Replay(final, [served[i] for i in final], token, min(margins))


def decision_margin(k: int) -> float:
    """Decisions farther than this from their threshold cannot flip between kernel and twin:
    two kernels.sampler.probs bands (both sides of a gap) plus one fp32 rounding (2^-24) per
    sequential addition of up to K terms."""
    return 2 * tolerance("kernels.sampler.probs", "fp32").max_rel + k * 2.0**-24


# --- inputs --------------------------------------------------------------------------------
def make_logits(R: int, V: int, seed: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * 2.5
    if kind == "ties":  # many exact ties, also at the top-k boundary
        x = (x * 2).round() / 2
    elif kind == "masked":  # -inf tokens, signed zeros
        x[torch.rand(R, V, generator=g) < 0.3] = -float("inf")
        x[:, 5:9] = torch.tensor([0.0, -0.0, 0.0, -0.0])
    elif kind == "peaked":  # top-k spread > 87: exps underflow to 0 inside the top-k
        x[:, :40] = torch.linspace(60.0, -60.0, 40)
    return x.contiguous()


def poisoned(R: int, W: int, device) -> SampleOut:
    return SampleOut(
        torch.full((R,), POISON_ID, dtype=torch.int64, device=device),
        torch.full((R, W), POISON_ID, dtype=torch.int64, device=device),
        torch.full((R, W), float("nan"), dtype=torch.float32, device=device),
    )


def run_kernel(x, params, seed, pos, n, tile, device, shards=1, purpose=Purpose.TARGET_SAMPLE,
               index=0, rows_garbage=True, select="rounds") -> SampleOut:
    """The kernel on a buffer whose padding rows (>= n) hold NaN/inf garbage; outputs poisoned
    first, padding outputs checked untouched."""
    R = x.shape[0]
    xb = x.clone()
    if rows_garbage:
        xb[n:] = float("nan")
        xb[n:, ::3] = float("inf")
    W = 1 if params.temperature == 0 else params.top_k
    out = poisoned(R, W, device)
    res = sample(xb.to(device), params, seed, pos.to(device), purpose, index, shards=shards,
                 n_live=torch.tensor([n], dtype=torch.int32, device=device), out=out,
                 config=SamplerLaunch(tile, 4, 4, select))
    assert res is out
    res = SampleOut(*(t.cpu() for t in res))
    assert (res.tokens[n:] == POISON_ID).all() and (res.ids[n:] == POISON_ID).all()
    assert res.probs[n:].isnan().all(), "a padding row was written"
    assert (res.tokens[:n] >= 0).all() and (res.ids[:n] != POISON_ID).all()
    assert not res.probs[:n].isnan().any(), "a live output was not written"
    return res


CASES = [  # (R, n_live, V, tile, params, kind)
    (1, 1, 1000, 256, SP(), "normal"),
    (3, 3, 4099, 1024, SP(0.7, 5, 0.9), "ties"),
    (8, 6, 1000, 512, SP(1.3, 64, 1.0), "normal"),
    (5, 5, 8193, 4096, SP(), "masked"),  # 3 tiles, the last holds one token
    (2, 2, 1000, 1024, SP(0.0, 20, 0.95), "ties"),  # greedy
    (4, 3, 4099, 2048, SP(1.0, 1, 0.5), "normal"),
    (6, 6, 1000, 64, SP(0.5, 5, 0.8), "ties"),  # 16 tiles >= K: tile maxima skip tiles
    (2, 2, 700, 32, SP(), "normal"),  # 22 tiles >= K = 20
    (3, 3, 1000, 256, SP(1.0, 20, 0.95), "peaked"),
    # 313 tiles (> 64): the merge finds τ by K rounds over the maxima and gathers K of 313
    (2, 2, 5000, 16, SP(), "ties"),
    (2, 1, 5000, 16, SP(0.8, 64, 0.9), "normal"),
]


def case_id(c) -> str:
    R, n, V, tile, p, kind = c
    return f"R{R}n{n}-V{V}-t{tile}-T{p.temperature}-k{p.top_k}-p{p.top_p}-{kind}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.slow
def test_sampler_against_replay_and_twin(case, device):
    R, n, V, tile, params, kind = case
    seed = 1000 + V + R
    x = make_logits(R, V, seed, kind)
    pos = torch.arange(R, dtype=torch.int64) * 7 + 11
    got = run_kernel(x, params, seed, pos, n, tile, device)
    u = uniforms(seed, pos[:n], Purpose.TARGET_SAMPLE).numpy()
    twin_tok, twin_ids, twin_probs = sample_ref(x, params, seed, pos, n_live=n)
    k = twin_ids.shape[1]
    near, worst = 0, None
    for r in range(n):
        exact = replay(x[r], params, u[r], device_exp(device))
        assert got.ids[r].tolist() == exact.ids, f"row {r}: ids / order"
        assert got.probs[r].numpy().tobytes() == np.array(exact.probs, F32).tobytes(), f"row {r}"
        assert int(got.tokens[r]) == exact.token, f"row {r}: token"
        mine = replay(x[r], params, u[r], torch_exp)  # the replay is the twin, bit for bit
        assert twin_ids[r].tolist() == mine.ids and int(twin_tok[r]) == mine.token
        assert twin_probs[r].numpy().tobytes() == np.array(mine.probs, F32).tobytes()
        if mine.margin <= decision_margin(k):
            near += 1  # a decision within the exp tolerance: flips allowed, counted
            continue
        assert got.ids[r].tolist() == twin_ids[r].tolist(), f"row {r}: ids vs twin"
        assert int(got.tokens[r]) == int(twin_tok[r]), f"row {r}: token vs twin"
        m = check(got.probs[r], twin_probs[r], "kernels.sampler.probs", "fp32")
        worst = m if worst is None or m.max_rel > worst.max_rel else worst
    print(f"\n  {case_id(case)}: near-boundary rows {near}/{n}; worst vs twin: {worst}")


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.slow
def test_random_configurations(seed, device):
    """Fresh random shapes, parameters, tiles and shard counts: exact against the replay, and
    every shard count bit-identical to one shard."""
    g = torch.Generator().manual_seed(5000 + seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    R, V = ri(1, 8), ri(20, 3000)
    n = ri(1, R)
    k = min(V, ri(1, MAX_TOP_K))
    T = [0.0, 0.3, 0.8, 1.0, 1.7][ri(0, 4)]
    params = SP(T, k, [1.0, 0.5, 0.9, 0.95, 0.99][ri(0, 4)])
    kp = max(2, triton_pow2(k))
    tile = fit_tile(V, kp, triton_pow2(V) >> ri(0, 6))
    shards = ri(2, 8)
    kind = ["normal", "ties", "masked", "peaked"][ri(0, 3)]
    x = make_logits(R, V, 6000 + seed, kind)
    pos = torch.randint(0, 2**32, (R,), generator=g)
    got = run_kernel(x, params, seed, pos, n, tile, device)
    u = uniforms(seed, pos[:n], Purpose.TARGET_SAMPLE).numpy()
    for r in range(n):
        exact = replay(x[r], params, u[r], device_exp(device))
        assert got.ids[r].tolist() == exact.ids, f"row {r}"
        check(got.probs[r], torch.from_numpy(np.array(exact.probs, F32)),
              "kernels.sampler.vs_replay", "fp32")
        assert int(got.tokens[r]) == exact.token, f"row {r}"
    stile = fit_tile(-(-V // shards), kp, triton_pow2(-(-V // shards)) >> ri(0, 3))
    split = run_kernel(x, params, seed, pos, n, stile, device, shards=shards)
    for a, b in zip(got, split, strict=True):
        assert a.numpy().tobytes() == b.numpy().tobytes(), f"{shards} shards"


def triton_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fit_tile(vocab: int, kp: int, tile: int) -> int:
    """The smallest power of two >= tile (and 16) whose tiles fit the merge's 1024 groups."""
    tile = max(16, triton_pow2(tile))
    while -(-vocab // tile) > 1024:
        tile *= 2
    return tile


# --- sharding ------------------------------------------------------------------------------
def boundary_ties(V: int, n_shards: int, seed: int) -> torch.Tensor:
    """[2, V] logits whose largest values tie across every shard boundary."""
    x = make_logits(2, V, seed, "normal")
    base, rem = divmod(V, n_shards)
    starts = [s * base + min(s, rem) for s in range(1, n_shards)]
    for j, b in enumerate(starts):
        x[:, b - 2 : b + 2] = 20.0 - (j % 3)  # 4 equal values straddling each boundary
    return x


@pytest.mark.parametrize("V,tile", [(1001, 128), (45, 16)])
@pytest.mark.slow
def test_sharded_is_bit_identical_to_unsharded(V, tile, device):
    """Shards follow torch.tensor_split: the first V % N shards hold one extra token. V = 45
    with N = 8 leaves shards of 5-6 tokens, fewer than K = 20."""
    params = SP(1.0, 20, 0.95)
    pos = torch.tensor([3, 4], dtype=torch.int64)
    for n_shards in (2, 4, 8):
        x = boundary_ties(V, n_shards, 77 + n_shards)
        one = run_kernel(x, params, 9, pos, 2, tile, device, rows_garbage=False)
        many = run_kernel(x, params, 9, pos, 2, tile, device, shards=n_shards,
                          rows_garbage=False)
        for a, b in zip(one, many, strict=True):
            assert a.numpy().tobytes() == b.numpy().tobytes(), f"N={n_shards}"
        u = uniforms(9, pos, Purpose.TARGET_SAMPLE).numpy()
        assert one.ids[0].tolist() == replay(x[0], params, u[0], device_exp(device)).ids
        assert len(set(one.ids[0, :4].tolist())) == 4 and one.probs[0, 0] == one.probs[0, 1]
    # a real TP rank: its slice only, then the gathered keys
    keys = torch.stack([topk_candidates(x[:, s].contiguous().to(device), params, int(s[0]), V,
                                        config=SamplerLaunch(tile, 4, 4))
                        for s in torch.arange(V).tensor_split(n_shards)])  # [N, R, KP]
    tp = sample_from_candidates(keys.permute(1, 0, 2), params, 9, pos.to(device), vocab=V)
    for a, b in zip(one, tp, strict=True):
        assert a.numpy().tobytes() == b.cpu().numpy().tobytes(), "TP path"


# --- ties, masks, greedy ---------------------------------------------------------------------
def test_total_order_on_ties_masks_and_signed_zeros(device):
    V = 40
    x = torch.full((4, V), -float("inf"))
    x[0] = 1.0  # all equal: ids 0..19 in index order, probabilities exactly 1/20
    x[1, 30:] = 0.0  # 10 finite tokens, K = 20: ten -inf candidates of probability 0
    x[2, ::2] = -0.0
    x[2, 1::2] = 0.0  # -0.0 ties +0.0 (torch.sort compares them equal)
    x[3, :27] = torch.arange(27.0) % 5  # 5 levels; K = 20 cuts level 1 (6 ties) after 5
    params = SP(1.0, 20, 1.0)
    pos = torch.arange(4, dtype=torch.int64) + 50
    got = run_kernel(x, params, 123, pos, 4, 16, device, rows_garbage=False)
    u = uniforms(123, pos, Purpose.TARGET_SAMPLE).numpy()
    for r in range(4):
        exact = replay(x[r], params, u[r], device_exp(device))
        assert got.ids[r].tolist() == exact.ids and int(got.tokens[r]) == exact.token
        assert got.probs[r].numpy().tobytes() == np.array(exact.probs, F32).tobytes()
    twin = sample_ref(x[:3], params, 123, pos[:3])
    for a, b in zip(got, twin, strict=True):  # rows 0-2: exps of 0 and -inf only, no exp gap
        assert torch.equal(a[:3], b)
    assert got.ids[0].tolist() == list(range(20))
    assert got.ids[1, :10].tolist() == list(range(30, 40)) and (got.probs[1, 10:] == 0).all()
    assert got.ids[1, 10:].tolist() == list(range(10))  # dropped candidates: index order
    assert got.ids[2].tolist() == list(range(20))
    assert got.ids[3].tolist() == [i + lv for lv in (4, 3, 2, 1) for i in range(0, 25, 5)]
    greedy = run_kernel(x, SP(0.0, 0, 1.0), 1, pos, 4, 16, device, rows_garbage=False)
    assert greedy.ids[:, 0].tolist() == [0, 30, 0, 4] and greedy.tokens.tolist() == [0, 30, 0, 4]


# --- the counter-based draw ----------------------------------------------------------------
@pytest.mark.slow
def test_draw_is_keyed_by_seed_position_purpose_index(device):
    """Flat rows (20 equal candidates): the token is a pure function of u."""
    x = torch.zeros(8, 64)
    params = SP(1.0, 20, 1.0)
    pos = torch.tensor([0, 5, 5, 2**32 - 1, 7, 7, 1000, 3], dtype=torch.int64)
    seeds = [0, 2**63 + 5, 2**64 - 1, 12345]
    for seed, purpose, index in zip(seeds, [*Purpose, Purpose.ACCEPT], (0, 3, 0, 2**32 - 1),
                                    strict=True):
        got = run_kernel(x, params, seed, pos, 8, 64, device, purpose=purpose, index=index,
                         rows_garbage=False)
        twin = sample_ref(x, params, seed, pos, purpose, index)
        assert torch.equal(got.tokens, twin[0]), (seed, purpose, index)
        assert got.tokens[1] == got.tokens[2] and got.tokens[4] == got.tokens[5]
        assert len(set(got.tokens.tolist())) >= 4  # the stream moves with the position
    as_tensor = torch.tensor([seeds[1] - 2**64], dtype=torch.int64, device=device)
    a = run_kernel(x, params, as_tensor, pos, 8, 64, device, rows_garbage=False)
    b = sample_ref(x, params, seeds[1], pos)
    assert torch.equal(a.tokens, b[0]), "seed given as a device tensor"
    again = run_kernel(x, params, as_tensor, pos, 8, 64, device, rows_garbage=False)
    assert torch.equal(a.tokens, again.tokens)
    # mutant: RNG keyed without the position (every row at position 0) fails the token row
    no_pos = run_kernel(x, params, seeds[1], torch.zeros(8, dtype=torch.int64), 8, 64, device,
                        rows_garbage=False)
    with pytest.raises(AssertionError):
        check(no_pos.tokens, b[0], "kernels.sampler.token", "int64")
    # mutant: purpose ignored (a draft sample reusing the target stream)
    wrong = run_kernel(x, params, seeds[1], pos, 8, 64, device, rows_garbage=False)
    with pytest.raises(AssertionError):
        check(wrong.tokens, sample_ref(x, params, seeds[1], pos, Purpose.DRAFT_SAMPLE)[0],
              "kernels.sampler.token", "int64")


def test_exp_gap_to_torch_is_the_tolerance_source(device):
    """kernel_exp vs torch.exp over z - m in [-104, 0]: the only unpinned step."""
    g = torch.Generator().manual_seed(4)
    v = torch.cat([-torch.rand(1 << 16, generator=g) * 104, -torch.rand(1 << 12, generator=g)])
    a = kernel_exp(v.to(device)).cpu()
    b = torch.exp(v.to(device)).cpu()
    normal = b >= 2.0**-126
    ulps = (a.view(torch.int32)[normal] - b.view(torch.int32)[normal]).abs().max().item()
    print(f"\n  kernel_exp vs torch.exp on {device}: <= {ulps} ulp (normal results)")
    assert ulps <= 3


# --- broken variants -----------------------------------------------------------------------
def test_broken_variants_fail_their_rows(device):
    x = make_logits(6, 300, 5, "normal")
    params = SP(0.8, 20, 0.7)
    pos = torch.arange(6, dtype=torch.int64)
    got = run_kernel(x, params, 3, pos, 6, 128, device, rows_garbage=False)
    V = x.shape[1]
    dense = torch.zeros(6, V).scatter_(1, got.ids, got.probs)
    twin = sample_ref(x, params, 3, pos)
    twin_dense = torch.zeros(6, V).scatter_(1, twin[1], twin[2])
    check(dense, twin_dense, "kernels.sampler.probs", "fp32")
    out = {}
    # top-p dropping the crossing token: a different support
    dropped = _drop_crossing_token(x, params)
    with pytest.raises(AssertionError) as e:
        check(dropped.ne(0), dense.ne(0), "kernels.sampler.ids", "int64")
    out["top-p drops the crossing token"] = str(e.value)[:60]
    # top-p before top-k (on the whole distribution, then cut to K)
    swapped = torch.stack([
        torch.tensor([float(d.get(i, 0.0)) for i in range(V)])
        for d in (served_f64(x[r].double().tolist(), params, swap=True)[0] for r in range(6))
    ])
    with pytest.raises(AssertionError) as e:
        check(swapped.ne(0), dense.ne(0), "kernels.sampler.ids", "int64")
    out["top-k/top-p order swapped"] = str(e.value)[:60]
    # probabilities not renormalized after top-p; probabilities carried in bf16
    kept = torch.zeros(6, V).scatter_(1, twin[1], twin[2].ne(0).float())
    full = sample_ref(x, SP(0.8, 20, 1.0), 3, pos)
    unnorm = torch.zeros(6, V).scatter_(1, full[1], full[2]) * kept
    for name, bad in (("no renormalization after top-p", unnorm),
                      ("bf16 probabilities", dense.bfloat16().float())):
        with pytest.raises(AssertionError) as e:
            check(bad, twin_dense, "kernels.sampler.probs", "fp32")
        out[name] = str(e.value)[:70]
    for k, v in out.items():
        print(f"\n  broken: {k}: {v}")


# --- errors --------------------------------------------------------------------------------
def test_wrapper_errors(device):
    x = torch.zeros(2, 100, device=device)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    cases = [
        (dict(params=SP(1.0, MAX_TOP_K + 1, 1.0)), "1 <= top_k <= 64"),
        (dict(params=SP(1.0, 0, 1.0)), "top_k = 0"),
        (dict(params=SP(1.0, 200, 1.0)), "top_k"),
        (dict(params=SP(-1.0, 20, 1.0)), "temperature"),
        (dict(logits=x.double()), "logits must have dtype"),
        (dict(logits=x[0]), "logits must have 2 dims"),
        (dict(logits=x.t().contiguous().t()[:, :50]), "unit column stride"),
        (dict(positions=pos[:1]), r"positions must be \[R=2\]"),
        (dict(positions=pos.float()), "positions must have dtype"),
        (dict(seed=-1), "seed must be"),
        (dict(seed=2**64), "seed must be"),
        (dict(seed=torch.zeros(2, dtype=torch.int64, device=device)), "one element"),
        (dict(purpose=9), "purpose"),
        (dict(index=2**32), "index"),
        (dict(shards=0), "shards"),
        (dict(shards=101), "shards"),
        (dict(n_live=torch.tensor([1], device=device)), "n_live must have dtype"),
        (dict(out=SampleOut(pos, pos[:, None], x)), r"out.ids must have shape \(2, 20\)"),
    ]
    base = dict(logits=x, params=SP(), seed=1, positions=pos)
    for kw, match in cases:
        args = base | kw
        with pytest.raises(ValueError, match=match):
            sample(args.pop("logits"), args.pop("params"), args.pop("seed"),
                   args.pop("positions"), **args)
    with pytest.raises(ValueError, match="power of two"):
        SamplerLaunch(100, 4, 4)
    with pytest.raises(ValueError, match="use a larger SamplerLaunch.tile"):
        sample(torch.zeros(1, 70000, device=device), SP(1.0, 64, 1.0), 1, pos[:1],
               config=SamplerLaunch(16, 4, 4))
    with pytest.raises(ValueError, match="vocab_offset"):
        topk_candidates(x, SP(), 50, 100)


# --- the compiled (GPU) branches build for sm_90 ---------------------------------------------
def _compile_sm90() -> dict[str, dict[str, int]]:
    """Compile every sampler / verify kernel variant for sm_90 with the wrappers' options (no
    GPU needed: Triton's bundled ptxas), ints equal to 1 specialized as a real launch does;
    count the PTX instructions the exactness argument rests on."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.sampler.device as S
    import kernels.verify as VF

    def build(fn, args, consts, warps=4, lib=True):
        args = [(n, t) for n, t in args if n not in consts]
        sig = dict(args) | {k: "constexpr" for k in consts}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs={})
        opts = {"num_warps": warps} | S._COMPILE
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        keys = ("div.rn.f32", "div.full", "div.approx", "fma.", "bar.sync", "ex2.approx.ftz")
        got = {k: ptx.count(k) for k in keys}
        got["ftz_other"] = ptx.count(".ftz") - got["ex2.approx.ftz"]
        return got

    i32 = "i32"
    scan = [("x_ptr", "*fp32"), ("cand_ptr", "*i64"), ("n_live_ptr", "*i32"),
            ("temperature", "fp32"), ("vals_ptr", "*fp32")] + [(n, i32) for n in (
                "id_offset", "shard_base", "shard_rem", "stride_xr", "stride_cr", "stride_cs",
                "stride_ct")]
    merge = [("cand_ptr", "*i64")] + [(n, i32) for n in (
        "stride_cr", "stride_cs", "stride_cg", "G")] + [("keys_ptr", "*i64")] + [
        (n, i32) for n in ("stride_kr", "stride_ks")] + [
        ("tok_ptr", "*i64"), ("ids_ptr", "*i64"), ("probs_ptr", "*fp32"), ("stride_ir", i32),
        ("stride_pr", i32), ("pos_ptr", "*i64"), ("seed", "u64"), ("seed_ptr", "*i64"),
        ("n_live_ptr", "*i32"), ("top_p", "fp32"), ("apply_top_p", i32), ("vals_ptr", "*fp32")
    ] + [(n, i32) for n in ("purpose", "index")]
    ver = [("p_ids_ptr", "*i64"), ("p_probs_ptr", "*fp32"), ("q_ids_ptr", "*i64"),
           ("q_probs_ptr", "*fp32"), ("drafts_ptr", "*i64"), ("nd_ptr", "*i32"), ("seed", "i64"),
           ("seed_ptr", "*i64"), ("first", "i64"), ("first_ptr", "*i64"), ("acc_ptr", "*i32"),
           ("tok_ptr", "*i64"), ("bonus_ptr", "*i32"), ("emit_ptr", "*i64"),
           ("wf_ptr", "*fp32"), ("wi_ptr", "*i64")] + [
        (n, i32) for n in ("D", "WP", "WQ", "s_pi", "s_pp", "s_qi", "s_qp", "b_pi", "b_pp",
                           "b_qi", "b_qp")]
    fin = {"K": 20, "KP": 32, "GP": 32, "SP": 32, "FINAL": True, "GREEDY": False,
           "SEED_FROM_PTR": False, "LIBDEVICE": True, "VALS_FROM_PTR": False, "PDL": False}
    vc = {"DP": 8, "KP": 32, "KQ": 32, "SEED_FROM_PTR": False, "FIRST_FROM_PTR": False,
          "PDL": False}
    return {
        "scan": build(S._scan_kernel, scan, {"K": 20, "KP": 32, "TILE": 2048, "GREEDY": False,
                                             "VALS_FROM_PTR": False, "PDL": False}, 4),
        "scan_vals_ptr": build(S._scan_kernel, scan, {"K": 20, "KP": 32, "TILE": 2048,
                                                      "GREEDY": False, "VALS_FROM_PTR": True,
                                                      "PDL": False}, 4),
        "scan_greedy": build(S._scan_kernel, scan, {"K": 1, "KP": 2, "TILE": 2048,
                                                    "GREEDY": True, "VALS_FROM_PTR": False,
                                                    "PDL": False}, 4),
        "merge_final": build(S._merge_kernel, merge, fin),
        "merge_final_no_libdevice": build(S._merge_kernel, merge, fin | {"LIBDEVICE": False}),
        "merge_final_seed_ptr_ones": build(S._merge_kernel, merge, fin | {
            "SEED_FROM_PTR": True, "G": 1, "index": 1, "purpose": 1, "apply_top_p": 1}),
        "merge_final_vals_ptr": build(S._merge_kernel, merge, fin | {"VALS_FROM_PTR": True}),
        "merge_local": build(S._merge_kernel, merge, fin | {"FINAL": False}),
        "merge_local_many_groups": build(S._merge_kernel, merge, fin | {"FINAL": False,
                                                                        "GP": 1024}),
        "merge_greedy": build(S._merge_kernel, merge, fin | {"K": 1, "KP": 2, "GREEDY": True}),
        "verify": build(VF._verify_kernel, ver, vc),
        "verify_ptrs_ones": build(VF._verify_kernel, ver, vc | {
            "SEED_FROM_PTR": True, "FIRST_FROM_PTR": True, "D": 1, "WP": 1, "WQ": 1, "DP": 2,
            "KP": 2, "KQ": 2}),
    }


@pytest.mark.slow
def test_compiled_kernels_build_for_sm90():
    """The interpreter runs NumPy; this compiles the GPU branches (a fresh process: under
    TRITON_INTERPRET the kernels are not compilable) and checks IEEE division everywhere, no
    FMA contraction (the variant without libdevice exp has no fma at all), no flush-to-zero
    outside libdevice's ex2 of a reduced argument, and the barriers of the scalar loops."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    for name, st in stats.items():
        assert st["div.full"] == 0 and st["div.approx"] == 0 and st["ftz_other"] == 0, name
    assert stats["scan"]["div.rn.f32"] > 0 and stats["scan"]["fma."] == 0
    assert stats["scan_vals_ptr"]["div.rn.f32"] > 0 and stats["scan_vals_ptr"]["fma."] == 0
    assert stats["merge_final_no_libdevice"]["fma."] == 0
    assert stats["verify"]["fma."] == 0 and stats["verify"]["bar.sync"] > 0
    assert stats["merge_final"]["bar.sync"] >= 5 and stats["merge_final"]["div.rn.f32"] > 0


# --- GPU only: the real shapes, CUDA graphs, no host sync, benchmark ---------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("R,shards", [(8, 1), (1, 1), (8, 8)])
def test_real_shapes(R, shards, device):
    """V = 160000 with the pinned launch (tiles of 2048), unsharded and as 8 shards of 20000."""
    V, params = 160000, SP()
    x = make_logits(R, V, 31 + R + shards, "normal")
    pos = torch.arange(R, dtype=torch.int64) + 123456
    out = poisoned(R, params.top_k, device)
    got = sample(x.to(device), params, 99, pos.to(device), shards=shards, out=out)
    got = SampleOut(*(t.cpu() for t in got))
    u = uniforms(99, pos, Purpose.TARGET_SAMPLE).numpy()
    twin = sample_ref(x, params, 99, pos)
    near = 0
    for r in range(R):
        exact = replay(x[r], params, u[r], device_exp(device))
        assert got.ids[r].tolist() == exact.ids and int(got.tokens[r]) == exact.token
        assert got.probs[r].numpy().tobytes() == np.array(exact.probs, F32).tobytes()
        if replay(x[r], params, u[r], torch_exp).margin <= decision_margin(params.top_k):
            near += 1
            continue
        assert torch.equal(got.ids[r], twin[1][r]) and got.tokens[r] == twin[0][r]
        check(got.probs[r], twin[2][r], "kernels.sampler.probs", "fp32")
    print(f"\n  R={R} shards={shards}: near-boundary rows {near}/{R}")


@pytest.mark.gpu
def test_cuda_graph_and_no_host_sync(device):
    R, V, params = 8, 160000, SP()
    x = make_logits(R, V, 8, "normal").to(device)
    pos = torch.arange(R, dtype=torch.int64, device=device)
    seed = torch.tensor([5], dtype=torch.int64, device=device)
    n = torch.tensor([R], dtype=torch.int32, device=device)
    out = poisoned(R, params.top_k, device)
    sample(x, params, seed, pos, n_live=n, out=out)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(x, params, seed, pos, n_live=n, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        sample(x, params, seed, pos, n_live=n, out=out)
    for live, s, shift in ((3, 7, 0), (8, 2**40, 1000), (1, 11, 5)):
        for t in out:
            t.fill_(POISON_ID)
        x.copy_(make_logits(R, V, s % 1000, "normal"))
        pos.copy_(torch.arange(R, device=device) + shift)
        seed.fill_(s)
        n.fill_(live)
        graph.replay()
        torch.cuda.synchronize()
        tok, ids, _ = sample_ref(x, params, s, pos, n_live=live)
        assert torch.equal(out.tokens[:live].cpu(), tok) and torch.equal(out.ids[:live].cpu(), ids)
        assert (out.tokens[live:] == POISON_ID).all(), "padding rows written"


@pytest.mark.gpu
def test_bench_sampler_8x160000(benchmark):
    from benchmarks.bench_sampler import SPECS, build_problem, check_against_twin, kernel_call

    pb = build_problem(SPECS[0], torch.device("cuda"), rotate_bytes=0)
    print(check_against_twin(pb))
    fn = kernel_call(pb)

    def step():
        fn()
        torch.cuda.synchronize()

    benchmark(step)


if __name__ == "__main__":
    print(json.dumps(_compile_sm90()))


@pytest.mark.parametrize("case", ["ties", "random-sharded", "greedy"])
@pytest.mark.slow
def test_bitonic_selection_gives_the_same_bits(case, device):
    """The two top-K selections of the scan and the merges (SamplerLaunch.select) pick the same
    ordered key set; a selection that dropped the K-th key or broke ties by id descending would
    change ids. Rows with many equal logits make the tie order matter."""
    g = torch.Generator().manual_seed(31)
    R, V = 3, 700
    x = torch.randn(R, V, generator=g)
    if case == "ties":
        x = (x * 2).round() / 2  # ~10 distinct values: long runs of equal keys
    params = SP(0.0 if case == "greedy" else 0.8, 20, 0.9)
    pos = torch.arange(R) + 40
    shards = 3 if case == "random-sharded" else 1
    a = run_kernel(x, params, 5, pos, R, 64, device, shards=shards)
    b = run_kernel(x, params, 5, pos, R, 64, device, shards=shards, select="bitonic")
    for u, v in zip(a, b, strict=True):
        assert u.numpy().tobytes() == v.numpy().tobytes()
    assert len(set(a.ids[0].tolist())) == a.ids.shape[1]
