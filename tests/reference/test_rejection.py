"""reference/rejection.py: speculative rejection sampling preserves the served target law.

1. The rule, in exact rationals of the served fp32 rows (p̂ = p/Σp, q̂ = q/Σq): the first
   emitted token has law exactly p̂, and over D = 2..3 Markov drafts the emitted stream has
   exactly the target chain's law. Planted mutants must break the same equalities.
2. The fp32 implementation, exhaustively over the 2^24-point uniform grid: acceptance regions,
   replacement intervals and the resulting emitted-token law (tolerance rows
   reference.residual_distribution and reference.emitted_token_law).
3. verify() with its real counter-based uniforms: a chi-square smoke test at ALPHA.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction as Fr

import pytest
import torch
from scipy import stats

from qualification.tolerances import check
from reference.config import SamplingDefaults as SP
from reference.rejection import VerifyResult, decide, residual_distribution, verify
from reference.rng import Purpose, uniforms
from reference.sampling import SamplingError, draw, sample, served_distribution
from tests.reference.test_rng import philox_py
from tests.reference.test_sampling import GRID, _drop_crossing_token, draw_runs_fp32, grid_segments

ALPHA = 1e-3
Row = list[Fr]


# --- the rule in exact arithmetic, with hooks for mutants -----------------------------------
def frac(t: torch.Tensor) -> Row:
    return [Fr(float(v)) for v in t.tolist()]


def norm(r: Row) -> Row:
    s = sum(r)
    return [v / s for v in r]


def residual_exact(p: Row, q: Row) -> Row:
    d = [max(Fr(0), a - b) for a, b in zip(p, q, strict=True)]
    return norm(d) if sum(d) else list(p)


def accept_min(p: Row, q: Row, d: int) -> Fr:
    return min(Fr(1), p[d] / q[d]) if q[d] else Fr(int(p[d] > 0))


@dataclass(frozen=True)
class Rule:
    accept: Callable[[Row, Row, int], Fr] = accept_min
    replacement: Callable[[Row, Row], Row] = residual_exact
    bonus_after_reject: bool = False


STANDARD = Rule()
MUTANTS = {
    "exact_match_acceptance": Rule(accept=lambda p, q, d: p[d]),  # accept iff target's y == d
    "ratio_inverted": Rule(accept=lambda p, q, d: min(Fr(1), q[d] / p[d]) if p[d] else Fr(0)),
    "replacement_from_p": Rule(replacement=lambda p, q: list(p)),
    "residual_not_renormalized": Rule(
        replacement=lambda p, q: [max(Fr(0), a - b) for a, b in zip(p, q, strict=True)]
    ),
    "bonus_after_rejection": Rule(bonus_after_reject=True),
}


def first_token_law(p: Row, q_used: Row, rule: Rule = STANDARD, q_drawn: Row | None = None):
    """P(emit t) = q(t)·a(t) + P(reject)·r(t); q_drawn: the law drafts really come from."""
    q_drawn = q_drawn or q_used
    a = [rule.accept(p, q_used, d) if q_drawn[d] else Fr(0) for d in range(len(p))]
    r = rule.replacement(p, q_used)
    rej = sum(qd * (1 - ad) for qd, ad in zip(q_drawn, a, strict=True))
    return [qd * ad + rej * rt for qd, ad, rt in zip(q_drawn, a, r, strict=True)]


def block_law(P: list[Row], Q: list[Row], x0: int, D: int, rule: Rule = STANDARD, Qd=None):
    """Law of one round's emitted block from context token x0 (Markov rows P[prev], Q[prev]);
    Qd: the rows drafts are really drawn from, when a mutant draws from other rows than Q."""
    Qd = Qd or Q
    law: dict[tuple[int, ...], Fr] = defaultdict(Fr)

    def rec(prev: int, j: int, prefix: tuple[int, ...], pr: Fr) -> None:
        if j == D:
            for t, v in enumerate(P[prev]):
                law[prefix + (t,)] += pr * v
            return
        p, q = P[prev], Q[prev]
        r = rule.replacement(p, q)
        for d, qd in enumerate(Qd[prev]):
            if not qd:
                continue
            a = rule.accept(p, q, d)
            if a:
                rec(d, j + 1, prefix + (d,), pr * qd * a)
            for t, rt in enumerate(r):
                w = pr * qd * (1 - a) * rt
                if rule.bonus_after_reject:  # the next row (conditioned on the rejected d)
                    for b, pb in enumerate(P[d]):
                        law[prefix + (t, b)] += w * pb
                else:
                    law[prefix + (t,)] += w

    rec(x0, 0, (), Fr(1))
    return {k: v for k, v in law.items() if v}


def stream_law(P, Q, x0: int, D: int, L: int, rule: Rule = STANDARD):
    """Law of the first L emitted tokens when rounds of depth D repeat from context x0."""
    out: dict[tuple[int, ...], Fr] = defaultdict(Fr)
    for blk, pr in block_law(P, Q, x0, D, rule).items():
        if len(blk) >= L:
            out[blk[:L]] += pr
        else:
            for rest, pr2 in stream_law(P, Q, blk[-1], D, L - len(blk), rule).items():
                out[blk + rest] += pr * pr2
    return {k: v for k, v in out.items() if v}


def chain_law(P, x0: int, L: int):
    out = {(): Fr(1)}
    for _ in range(L):
        out = {
            s + (t,): pr * P[s[-1] if s else x0][t]
            for s, pr in out.items()
            for t in range(len(P))
            if P[s[-1] if s else x0][t]
        }
    return out


# --- served rows used throughout ----------------------------------------------------------
SETTINGS = [SP(1.0, 0, 1.0), SP(0.7, 4, 0.9), SP(1.0, 6, 0.95), SP(1.5, 0, 0.8)]


def served_pair(V: int, seed: int, params: SP, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(1, V, generator=g)
    d = t + torch.randn(1, V, generator=g) * spread
    return served_distribution(t, params)[0], served_distribution(d, params)[0]


CASES = [(V, s, prm) for V, s in [(6, 0), (9, 1), (12, 2)] for prm in SETTINGS]


def case_id(c):
    return f"V{c[0]}-{c[2].temperature}-{c[2].top_k}-{c[2].top_p}"


# --- 1. exact law of the rule -------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_first_token_law_is_exactly_the_target(case):
    V, seed, params = case
    p, q = served_pair(V, seed, params)
    ph, qh = norm(frac(p)), norm(frac(q))
    assert first_token_law(ph, qh) == ph
    for name, rule in MUTANTS.items():
        if name != "bonus_after_rejection":  # only visible beyond the first token
            assert first_token_law(ph, qh, rule) != ph, name


@pytest.mark.parametrize("case", CASES[:8], ids=case_id)
def test_sampling_mutants_break_the_first_token_law(case):
    V, seed, params = case
    g = torch.Generator().manual_seed(seed + 100)
    t = torch.randn(1, V, generator=g)
    d = t + torch.randn(1, V, generator=g)
    ph = norm(frac(served_distribution(t, params)[0]))
    qh = norm(frac(served_distribution(d, params)[0]))
    assert first_token_law(ph, qh) == ph
    # the draft sampled at temperature 1 but its q was served at `params` (draft ignores T)
    q_t1 = norm(frac(served_distribution(d, replace(params, temperature=1.0))[0]))
    if params.temperature != 1.0:
        assert first_token_law(ph, qh, q_drawn=q_t1) != ph
    # the verifier's p from a sampler that drops the token crossing top_p
    if params.top_p < 1.0:
        bad = norm(frac(_drop_crossing_token(t, params)[0]))
        assert bad != ph
        assert first_token_law(bad, qh) != ph


def markov(V: int, seed: int, params: SP, draft_params: SP | None = None):
    """Target and draft transition rows [V(prev), V] from served logits."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(V, V, generator=g) * 1.5
    d = t + torch.randn(V, V, generator=g) * 1.2
    return served_distribution(t, params), served_distribution(d, draft_params or params)


MARKOV = [(3, 2, SP(1.0, 0, 1.0)), (3, 3, SP(0.8, 0, 0.9)), (4, 2, SP(1.0, 3, 0.95))]


@pytest.mark.parametrize("V,D,params", MARKOV)
def test_emitted_stream_has_the_target_chain_law(V, D, params):
    P, Q = markov(V, 7 + V + D, params)
    Ph, Qh = [norm(frac(r)) for r in P], [norm(frac(r)) for r in Q]
    for x0 in range(V):
        assert stream_law(Ph, Qh, x0, D, D + 1) == chain_law(Ph, x0, D + 1)
        blocks = block_law(Ph, Qh, x0, D)
        assert sum(blocks.values()) == 1 and max(map(len, blocks)) == D + 1
    for name, rule in MUTANTS.items():
        if name == "residual_not_renormalized":
            continue  # its "law" does not sum to one; covered by the first-token check
        assert any(
            stream_law(Ph, Qh, x0, D, D + 1, rule) != chain_law(Ph, x0, D + 1) for x0 in range(V)
        ), name


# --- 2. the fp32 implementation on the whole uniform grid ---------------------------------
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_residual_distribution_matches_the_exact_residual(case):
    p, q = served_pair(*case)
    r = residual_distribution(p, q)
    want = torch.tensor([float(v) for v in residual_exact(frac(p), frac(q))], dtype=torch.float64)
    check(r.double(), want, "reference.residual_distribution", "fp32")
    unnormalized = torch.clamp_min(p - q, 0).double()
    with pytest.raises(AssertionError):
        check(unnormalized, want, "reference.residual_distribution", "fp32")


def test_residual_of_equal_rows_is_p():
    g = torch.Generator().manual_seed(5)
    p = served_distribution(torch.randn(1, 7, generator=g), SP(1.0, 0, 1.0))[0]
    assert torch.equal(residual_distribution(p, p), p)


def _accept_count(p: torch.Tensor, q: torch.Tensor, d: int) -> int:
    """#{k : decide accepts d with u_acc = k/2^24}, by bisection on the implementation."""
    p2 = torch.stack([p, p])  # [D+1 = 2, V]; the bonus row is not reached when d is rejected

    def ok(k: int) -> bool:
        u = torch.tensor([k / GRID], dtype=torch.float32)
        return decide(p2, q[None], torch.tensor([d]), u, torch.zeros(2)).n_accepted == 1

    lo, hi = 0, GRID
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if ok(mid) else (lo, mid)
    g = torch.Generator().manual_seed(d)
    for k in torch.randint(0, GRID, (16,), generator=g).tolist() + [lo - 1, lo]:
        if 0 <= k < GRID:
            assert ok(k) == (k < lo), "acceptance region is not a prefix of the grid"
    return lo


def _accept_count_fp32(p: float, q: float) -> int:
    """Replay of fl(u·q) < p on numpy float32 scalars."""
    import numpy as np

    lo, hi = 0, GRID
    while lo < hi:
        mid = (lo + hi) // 2
        if np.float32(mid / GRID) * np.float32(q) < np.float32(p):
            lo = mid + 1
        else:
            hi = mid
    return lo


def implementation_law(p: torch.Tensor, q: torch.Tensor, replacement_from_p: bool = False):
    """Exact law (rationals) of the first emitted token over the grid of both uniforms."""
    q_runs = draw_runs_fp32(q.tolist())  # the draft's own draw(q)
    acc = {}
    for _, _, d in q_runs:
        acc[d] = _accept_count(p, q, d)
        assert acc[d] == _accept_count_fp32(p[d].item(), q[d].item())
        ideal = min(Fr(1), Fr(p[d].item()) / Fr(q[d].item()))
        assert 0 <= math.ceil(ideal * GRID) - acc[d] <= 2  # fp32 product rounding only
    law: dict[int, Fr] = defaultdict(Fr)
    rej = Fr(0)
    for a, b, d in q_runs:
        law[d] += Fr(b - a, GRID) * Fr(acc[d], GRID)
        rej += Fr(b - a, GRID) * Fr(GRID - acc[d], GRID)
    if rej:
        d_rej = next(d for d in acc if acc[d] < GRID)
        u_rej = torch.tensor([(GRID - 1) / GRID], dtype=torch.float32)

        def f(k: int) -> int:
            u = torch.tensor([k / GRID], dtype=torch.float32)
            us = torch.cat([u, torch.zeros(1)])
            return decide(torch.stack([p, p]), q[None], torch.tensor([d_rej]), u_rej, us).next_token

        runs = grid_segments(f)
        assert runs == draw_runs_fp32(residual_distribution(p, q).tolist())
        if replacement_from_p:
            runs = draw_runs_fp32(p.tolist())
        for a, b, t in runs:
            law[t] += rej * Fr(b - a, GRID)
    return law, rej


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_implementation_law_on_the_uniform_grid(case):
    p, q = served_pair(*case, spread=2.0)
    law, rej = implementation_law(p, q)
    assert sum(law.values()) == 1
    ph = norm(frac(p))
    V = len(ph)
    got = torch.tensor([float(law.get(t, 0)) for t in range(V)], dtype=torch.float64)
    want = torch.tensor([float(v) for v in ph], dtype=torch.float64)
    print(check(got, want, "reference.emitted_token_law", "fp32"))
    assert rej > 0.05  # spread=2 makes rejections common, so the mutant below is visible
    bad, _ = implementation_law(p, q, replacement_from_p=True)
    bad_t = torch.tensor([float(bad.get(t, 0)) for t in range(V)], dtype=torch.float64)
    with pytest.raises(AssertionError):
        check(bad_t, want, "reference.emitted_token_law", "fp32")


def test_verify_uses_the_pinned_counters():
    p, q = served_pair(8, 3, SP(1.0, 0, 1.0))
    P, Q = torch.stack([p, p, p]), torch.stack([q, q])
    seed, first = 0xC0FFEE, 4000
    key = (seed & 0xFFFFFFFF, seed >> 32)

    def u(pos: int, purpose: Purpose) -> float:
        return (philox_py((pos, int(purpose), 0, 0), key)[0] >> 8) / GRID

    seen = set()
    for trial in range(60):
        f = first + 3 * trial
        drafts = torch.tensor([int(q.argmax()), int(q.argmin())])
        ua = torch.tensor([u(f, Purpose.ACCEPT), u(f + 1, Purpose.ACCEPT)])
        us = torch.tensor([u(f + j, Purpose.TARGET_SAMPLE) for j in range(3)])
        got = verify(P, Q, drafts, seed, f)
        assert got == decide(P, Q, drafts, ua, us)
        seen.add((got.n_accepted, got.bonus))
    assert {0, 1, 2} <= {n for n, _ in seen}


def test_depth_zero_is_plain_sampling():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(1, 10, generator=g)
    params = SP(0.9, 5, 0.9)
    for pos in range(50):
        tok, probs = sample(logits, params, 99, torch.tensor([pos]))
        got = verify(probs, torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64), 99, pos)
        assert got == VerifyResult(0, int(tok[0]), True)


# --- 3. Monte Carlo smoke test of verify() with real uniforms ------------------------------
def _chi2_p(counts: Counter, law: dict) -> float:
    """Pearson chi-square p-value of counts against an exact law; cells with expected count
    < 5 are pooled. An outcome outside the law's support gives 0."""
    if not set(counts) <= set(law):
        return 0.0
    n = sum(counts.values())
    obs, exp, po, pe = [], [], 0, 0.0
    for c in sorted(law, key=lambda k: -law[k]):
        e = n * float(law[c])
        if e < 5:
            po, pe = po + counts.get(c, 0), pe + e
        else:
            obs.append(counts.get(c, 0))
            exp.append(e)
    if pe:
        obs.append(po)
        exp.append(pe)
    scale = n / sum(exp)  # float rounding of the law only
    return stats.chisquare(obs, [e * scale for e in exp]).pvalue


def _run_rounds(P, Q, Qd, x0: int, D: int, n: int, seed: int, via_verify: int) -> Counter:
    """n rounds from context x0: drafts by draw(Qd[prev]) with DRAFT_SAMPLE uniforms, then
    decide() with the same ACCEPT/TARGET_SAMPLE uniforms verify() uses; the first `via_verify`
    rounds also call verify() itself and must agree exactly."""
    first = 10 + torch.arange(n, dtype=torch.int64) * (D + 1)  # [N] disjoint positions
    prev = torch.full((n,), x0, dtype=torch.int64)
    drafts = []
    for j in range(D):
        prev = draw(Qd[prev], uniforms(seed, first + j, Purpose.DRAFT_SAMPLE))  # [N]
        drafts.append(prev)
    drafts = torch.stack(drafts, 1)  # [N, D]
    ctx = torch.cat([torch.full((n, 1), x0), drafts], 1)  # [N, D+1]
    ua = torch.stack([uniforms(seed, first + j, Purpose.ACCEPT) for j in range(D)], 1)
    us = torch.stack([uniforms(seed, first + j, Purpose.TARGET_SAMPLE) for j in range(D + 1)], 1)
    out = Counter()
    for i in range(n):
        p, q = P[ctx[i]], Q[ctx[i, :D]]
        res = decide(p, q, drafts[i], ua[i], us[i])
        if i < via_verify:
            assert verify(p, q, drafts[i], seed, int(first[i])) == res
        out[tuple(res.emitted(drafts[i]))] += 1
    return out


@pytest.mark.slow
def test_verify_monte_carlo_matches_the_exact_block_law():
    V, D, params = 3, 2, SP(0.7, 0, 1.0)
    P, Q = markov(V, 31, params)
    Ph, Qh = [norm(frac(r)) for r in P], [norm(frac(r)) for r in Q]
    law = block_law(Ph, Qh, 0, D)
    counts = _run_rounds(P, Q, Q, 0, D, 20000, seed=2718, via_verify=500)
    assert _chi2_p(counts, law) > ALPHA
    # Sensitivity: the draft ignores temperature (draws at T=1, reports q at T=0.7). Its exact
    # law gives the check >= 99% power already at 5000 rounds, and this seed must fail.
    _, Qd = markov(V, 31, params, draft_params=replace(params, temperature=1.0))
    bad_law = block_law(Ph, Qh, 0, D, Qd=[norm(frac(r)) for r in Qd])
    lam = 5000 * sum(float((bad_law.get(c, 0) - v) ** 2 / v) for c, v in law.items())
    crit = stats.chi2.ppf(1 - ALPHA, len(law) - 1)
    assert stats.ncx2.sf(crit, len(law) - 1, lam) >= 0.99
    bad = _run_rounds(P, Q, Qd, 0, D, 5000, seed=2718, via_verify=0)
    assert _chi2_p(bad, law) < ALPHA


# --- errors --------------------------------------------------------------------------------
def test_bad_verify_inputs_raise_named_errors():
    p, q = served_pair(6, 0, SP(1.0, 0, 1.0))
    P, Q, d = torch.stack([p, p]), q[None], torch.tensor([int(q.argmax())])
    with pytest.raises(SamplingError, match="D\\+1"):
        verify(P[:1], Q, d, 1, 0)
    with pytest.raises(SamplingError, match="q must be"):
        verify(P, torch.stack([q, q]), d, 1, 0)
    with pytest.raises(SamplingError, match="drafts must lie"):
        verify(P, Q, torch.tensor([6]), 1, 0)
    with pytest.raises(SamplingError, match="int64"):
        verify(P, Q, d.to(torch.int32), 1, 0)
    q0 = q.clone()
    q0[int(d[0])] = 0
    with pytest.raises(SamplingError, match="actually sampled"):
        verify(P, q0[None], d, 1, 0)
    with pytest.raises(SamplingError, match="first_position"):
        verify(P, Q, d, 1, 1.5)
    with pytest.raises(SamplingError, match="2\\^32"):
        verify(P, Q, d, 1, 2**32 - 1)
    with pytest.raises(SamplingError, match="2\\^32"):
        verify(P, Q, d, 1, -1)
    with pytest.raises(ValueError, match="seed"):
        verify(P, Q, d, -5, 0)
    with pytest.raises(SamplingError, match="u_accept"):
        decide(P, Q, d, torch.zeros(2), torch.zeros(2))
    with pytest.raises(SamplingError, match="residual_distribution"):
        residual_distribution(p, q[:5])
