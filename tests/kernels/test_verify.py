"""kernels/verify.py against its twin reference.twins.verify.verify_ref
(reference.rejection.verify on the densified rows): bit-exact (row kernels.verify). p and q
come from the reference sampler itself, so both sides see the same fp32 values; the cases
cover D = 0…7, greedy and top-k/top-p rows, ties, acceptance exactly at fl(u·q) = p, a
residual of zero mass, drafts outside the target support and garbage padding rows.

Dimension letters: D drafts, V vocabulary, Kp / Kq served widths.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

from iquestrt.capture import graph_capture
from kernels.verify import verify
from qualification.tolerances import check
from reference.config import SamplingDefaults as SP
from reference.op_types import VerifyOut
from reference.rejection import residual_distribution
from reference.rng import Purpose, uniforms
from reference.sampling import draw
from reference.twins.sampler import sample_ref
from reference.twins.verify import densify, verify_ref

POISON = -7


class Round(NamedTuple):
    p_ids: torch.Tensor  # [D+1, Kp]
    p_probs: torch.Tensor
    q_ids: torch.Tensor  # [D, Kq]
    q_probs: torch.Tensor
    drafts: torch.Tensor  # [D]
    seed: int
    first: int


def sampled_round(D: int, V: int, params: SP, seed: int, spread: float = 1.0) -> Round:
    """Target rows for positions first…first+D, draft rows for first…first+D-1, drafts drawn
    from the draft's served rows with DRAFT_SAMPLE uniforms (all by the reference sampler)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(D + 1, V, generator=g) * 2
    d = t[:D] + torch.randn(D, V, generator=g) * spread
    first = 17 * seed + 3
    pos = first + torch.arange(D + 1, dtype=torch.int64)
    _, p_ids, p_probs = sample_ref(t, params, seed, pos)
    if D:
        drafts, q_ids, q_probs = sample_ref(d, params, seed, pos[:D], Purpose.DRAFT_SAMPLE)
    else:
        W = p_ids.shape[1]
        drafts, q_ids, q_probs = torch.zeros(0, dtype=torch.int64), p_ids[:0], p_probs[:0]
        assert q_ids.shape == (0, W)
    return Round(p_ids, p_probs, q_ids, q_probs, drafts, seed, first)


def run(rnd: Round, device, n_drafts: int | None = None, first=None, seed=None,
        id_dtype=torch.int64) -> tuple[int, int, bool, list[int]]:
    D = rnd.drafts.shape[0]
    out = VerifyOut(*(torch.full(s, POISON, dtype=dt, device=device) for s, dt in (
        ((1,), torch.int32), ((1,), torch.int64), ((1,), torch.int32), ((D + 1,), torch.int64))))
    nd = None if n_drafts is None else torch.tensor([n_drafts], dtype=torch.int32, device=device)
    res = verify(rnd.p_ids.to(device, id_dtype), rnd.p_probs.to(device),
                 rnd.q_ids.to(device, id_dtype), rnd.q_probs.to(device),
                 rnd.drafts.to(device, id_dtype), rnd.seed if seed is None else seed,
                 rnd.first if first is None else first, n_drafts=nd, out=out)
    assert res is out
    a, tok, bonus, emitted = (t.cpu() for t in res)
    a, tok = int(a), int(tok)
    assert 0 <= a <= D and tok >= 0 and int(bonus) in (0, 1), "an output was not written"
    em = emitted.tolist()
    assert all(v == -1 for v in em[a + 1 :]) and em[a] == tok, f"emitted tail: {em}"
    return a, tok, bool(int(bonus)), em[: a + 1]


def assert_same(got, want, what: str) -> None:
    a = torch.tensor([got[0], got[1], int(got[2]), *got[3]])
    b = torch.tensor([want[0], want[1], int(want[2]), *want[3]])
    assert a.shape == b.shape, f"{what}: emitted {got[3]} vs {want[3]}"
    check(a, b, "kernels.verify", "int64")


PARAMS = [SP(), SP(0.7, 5, 0.9), SP(1.3, 64, 1.0), SP(0.0, 20, 0.95)]
RANDOM = [(D, p, s) for D in range(8) for p in PARAMS for s in (1, 2)]


def _round_id(c) -> str:
    D, p, s = c
    return f"D{D}-T{p.temperature}-k{p.top_k}-p{p.top_p}-s{s}"


@pytest.mark.parametrize("D", range(8))
@pytest.mark.slow
def test_random_rounds_match_the_twin(D, device):
    seen = set()
    for _, params, s in (c for c in RANDOM if c[0] == D):
        for spread in (0.5, 2.0):
            rnd = sampled_round(D, 300, params, 100 * D + 10 * s + int(spread * 2), spread)
            got = run(rnd, device)
            want = verify_ref(*rnd)
            assert_same(got, want, _round_id((D, params, s)))
            seen.add((got[0], got[2]))
    print(f"\n  D={D}: (accepted, bonus) outcomes seen: {sorted(seen)}")
    if D >= 2:
        assert len(seen) >= 2, "cases never varied the outcome"


def test_depth_zero_is_the_samplers_token(device):
    for s, params in enumerate(PARAMS):
        rnd = sampled_round(0, 300, params, 40 + s)
        g = torch.Generator().manual_seed(40 + s)
        t = torch.randn(1, 300, generator=g) * 2
        tok = sample_ref(t, params, rnd.seed, torch.tensor([rnd.first]))[0]
        assert run(rnd, device) == (0, int(tok[0]), True, [int(tok[0])])


def _u(seed: int, pos: int, purpose: Purpose) -> np.float32:
    return np.float32(uniforms(seed, torch.tensor([pos]), purpose)[0].item())


def hand_round(p_rows, q_rows, drafts, seed=5, first=1000) -> Round:
    """Sparse rows given as {id: prob} dicts (padded with id -1, prob 0)."""
    def pack(rows):
        w = max([len(r) for r in rows] + [1])
        ids = torch.full((len(rows), w), -1, dtype=torch.int64)
        pr = torch.zeros(len(rows), w)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(list(r.keys()), dtype=torch.int64)
            pr[i, : len(r)] = torch.tensor(list(r.values()), dtype=torch.float32)
        return ids, pr

    (pi, pp), (qi, qp) = pack(p_rows), pack(q_rows)
    return Round(pi, pp, qi, qp, torch.tensor(drafts, dtype=torch.int64), seed, first)


def test_acceptance_exactly_at_the_product_boundary(device):
    seed, first = 5, 1000
    q0, q1 = np.float32(0.3), np.float32(0.45)
    at0 = np.float32(_u(seed, first, Purpose.ACCEPT) * q0)  # fl(u·q)
    at1 = np.float32(_u(seed, first + 1, Purpose.ACCEPT) * q1)
    above = np.nextafter(at0, np.float32(1))
    assert 0 < at1 and 0 < above
    p = [{4: float(above), 9: 0.5}, {2: float(at1), 9: 0.25}, {1: 0.5, 2: 0.5}]
    q = [{4: float(q0), 7: 0.7}, {2: float(q1), 8: 0.55}]
    rnd = hand_round(p, q, [4, 2], seed, first)
    got = run(rnd, device)
    assert got[:3] == (1, got[1], False), "p = fl(u·q) must reject, the next float accept"
    assert_same(got, verify_ref(*rnd), "boundary")
    # q(d) = p(d): accepted (u < 1)
    same = hand_round([{3: 0.25, 5: 0.75}] * 2, [{3: 0.25, 6: 0.75}], [3], seed, first)
    assert run(same, device)[:3] == (1, run(same, device)[1], True)
    assert_same(run(same, device), verify_ref(*same), "q = p")


@pytest.mark.slow
def test_residual_zero_mass_ties_and_outside_support(device):
    # draft 11 outside p's support: always rejected; p <= q everywhere: residual mass 0 → p
    zero = hand_round([{3: 0.3, 5: 0.1}, {1: 1.0}], [{11: 0.25, 3: 0.3, 5: 0.45}], [11])
    got = run(zero, device)
    assert got[0] == 0 and not got[2] and got[1] in (3, 5)
    assert_same(got, verify_ref(*zero), "zero residual")
    # residual ties: 0.5-0.25 = 0.3125-0.0625 → ids 3 and 7 tie, id order decides
    for first in range(2000, 2040):
        tie = hand_round([{7: 0.5, 3: 0.3125, 9: 0.1875}, {1: 1.0}],
                         [{7: 0.25, 3: 0.0625, 9: 0.6875}], [9], first=first)
        assert_same(run(tie, device), verify_ref(*tie), f"residual tie, first={first}")
    # bonus row with ties; D = 1 all accepted
    bonus = hand_round([{2: 0.5}, {8: 0.25, 4: 0.25, 6: 0.5}], [{2: 0.5}], [2])
    got = run(bonus, device)
    assert got[0] == 1 and got[2] and got[1] in (4, 6, 8)
    assert_same(got, verify_ref(*bonus), "bonus ties")


def test_padding_rows_and_device_side_arguments(device):
    rnd = sampled_round(5, 200, SP(), 77, spread=1.5)
    for n in (0, 2, 5):
        bad = rnd._replace(p_ids=rnd.p_ids.clone(), p_probs=rnd.p_probs.clone(),
                           q_ids=rnd.q_ids.clone(), q_probs=rnd.q_probs.clone(),
                           drafts=rnd.drafts.clone())
        bad.p_probs[n + 1 :] = float("nan")
        bad.p_ids[n + 1 :] = 10**6
        bad.q_probs[n:] = float("inf")
        bad.q_ids[n:] = -5
        bad.drafts[n:] = 10**6
        got = run(bad, device, n_drafts=n)
        assert_same(got, verify_ref(*rnd, n_drafts=n), f"n_drafts={n}")
    want = verify_ref(*rnd._replace(seed=2**63 + 9))
    seed_t = torch.tensor([2**63 + 9 - 2**64], dtype=torch.int64, device=device)
    first_t = torch.tensor([rnd.first], dtype=torch.int64, device=device)
    got = run(rnd, device, first=first_t, seed=seed_t, id_dtype=torch.int32)
    assert_same(got, want, "device-side seed/first, int32 ids")


# --- broken variants -----------------------------------------------------------------------
def mutant(rnd: Round, kind: str) -> tuple[int, int, bool, list[int]]:
    """reference.rejection's rule with one planted bug, on the same uniforms."""
    D = rnd.drafts.shape[0]
    V = 1 + max(int(rnd.p_ids.max()), int(rnd.q_ids.max()) if D else 0)
    P, Q = densify(rnd.p_ids, rnd.p_probs, V), densify(rnd.q_ids, rnd.q_probs, V)
    pos = rnd.first + torch.arange(D + 1, dtype=torch.int64)
    ua = uniforms(rnd.seed, pos[:D], Purpose.ACCEPT)
    us = uniforms(rnd.seed, pos, Purpose.TARGET_SAMPLE)
    dr = rnd.drafts.tolist()
    for j, d in enumerate(dr):
        if kind == "exact-match acceptance":
            ok = d == int(draw(P[j : j + 1], us[j : j + 1])[0])
        elif kind == "p/q inverted":
            ok = bool(ua[j] * P[j, d] < Q[j, d])
        else:
            ok = bool(ua[j] * Q[j, d] < P[j, d])
        if not ok:
            r = P[j] if kind == "replacement drawn from p" else residual_distribution(P[j], Q[j])
            tok = int(draw(r[None], us[j : j + 1])[0])
            em = dr[:j] + [tok]
            if kind == "bonus after a rejection":
                em.append(int(draw(P[j + 1 : j + 2], us[j + 1 : j + 2])[0]))
            return j, tok, False, em
    tok = int(draw(P[D:], us[D:])[0])
    return D, tok, True, dr + [tok]


@pytest.mark.slow
def test_broken_variants_fail_their_row(device):
    rounds = [sampled_round(D, 300, prm, 900 + 10 * D + i, spread=1.5)
              for D in range(1, 8) for i, prm in enumerate((SP(), SP(1.3, 64, 1.0)))]
    wants = [verify_ref(*r) for r in rounds]
    for r, w in zip(rounds, wants, strict=True):
        assert_same(run(r, device), w, "control")
    kinds = ["exact-match acceptance", "p/q inverted", "replacement drawn from p",
             "bonus after a rejection"]
    for kind in kinds:
        assert mutant(rounds[0], "none") == wants[0]  # the harness itself is the reference
        bad = sum(mutant(r, kind) != w for r, w in zip(rounds, wants, strict=True))
        print(f"\n  broken: {kind}: {bad}/{len(rounds)} rounds differ")
        with pytest.raises(AssertionError):
            for r, w in zip(rounds, wants, strict=True):
                assert_same(mutant(r, kind), w, kind)
    # RNG keyed without the position: the kernel at position 0
    with pytest.raises(AssertionError):
        for r, w in zip(rounds, wants, strict=True):
            assert_same(run(r, device, first=0), w, "no position")


def test_wrapper_errors(device):
    rnd = sampled_round(2, 50, SP(), 3)
    args = [t.to(device) for t in rnd[:5]] + [rnd.seed, rnd.first]
    cases = [
        (0, args[0][:2], r"p_ids must have shape \(3, \*\)"),
        (1, args[1].double(), "p_probs must have dtype"),
        (2, args[2].float(), "q_ids must have dtype"),
        (3, args[3][:, :5], r"q_probs must have shape \(2, 20\)"),
        (4, torch.zeros(16, dtype=torch.int64, device=device), "at most 15 drafts"),
        (5, -1, "seed must be"),
        (6, 2**32 - 2, "first_position"),
        (6, 1.5, "first_position"),
    ]
    for i, bad, match in cases:
        a = list(args)
        a[i] = bad
        with pytest.raises(ValueError, match=match):
            verify(*a)
    with pytest.raises(ValueError, match="n_drafts must have dtype"):
        verify(*args, n_drafts=torch.tensor([1], device=device))
    with pytest.raises(ValueError, match="rows must have 1..64"):
        verify(args[0].repeat(1, 4), args[1].repeat(1, 4), *args[2:])


# --- GPU only: CUDA graph, device-side arguments, no host sync ---------------------------------
@pytest.mark.gpu
def test_cuda_graph_and_no_host_sync(device):
    D = 7
    rnd = sampled_round(D, 1000, SP(), 5, spread=1.0)
    dev = [t.to(device) for t in rnd[:5]]
    seed = torch.tensor([rnd.seed], dtype=torch.int64, device=device)
    first = torch.tensor([rnd.first], dtype=torch.int64, device=device)
    nd = torch.tensor([D], dtype=torch.int32, device=device)
    out = verify(*dev, seed, first, n_drafts=nd)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        verify(*dev, seed, first, n_drafts=nd, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        verify(*dev, seed, first, n_drafts=nd, out=out)
    for s in range(6):
        new = sampled_round(D, 1000, SP(), 50 + s, spread=1.0)
        for buf, src in zip(dev, new[:5], strict=True):
            buf.copy_(src)
        seed.fill_(new.seed)
        first.fill_(new.first)
        nd.fill_(s + 1)
        for t in out:
            t.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        a = int(out.n_accepted)
        got = (a, int(out.next_token), bool(int(out.bonus)), out.emitted[: a + 1].tolist())
        assert_same(got, verify_ref(*new, n_drafts=s + 1), f"replay {s}")
