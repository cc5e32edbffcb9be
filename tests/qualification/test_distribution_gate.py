"""Gate 5 (qualification/distribution*.py): the exact block law, the G-test and its power, and
the planted defects the gate must catch.

1. The exact law equals an independent from-the-definition enumeration; its identities with the
   target chain hold in rationals on every case, and break under planted rule defects.
2. Cells, G statistic and noncentrality against scipy's own routines; impossible outcomes fail.
3. Power, empirically: an exact-law sampler on the gate's N and α/m, tilted by TV 0.01 through
   its uniforms, is rejected in (nearly) every seeded repetition; untilted it never is; at N/4 the
   detection rate falls as the noncentral χ² predicts.
4. The reference path passes at full power and reruns bit for bit; five mutants of the real path
   fail the gate; a mutated verify is caught by the audit alone.
"""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction as Fr

import numpy as np
import pytest
import torch
from scipy import stats

from negative_controls import rejection_controls
from qualification.distribution import CASES, DistributionConfig, run, run_case, smoke
from qualification.distribution_law import (
    STANDARD,
    Noncentrality,
    Rule,
    block_law,
    choose_n,
    decode,
    encode,
    encode_tuple,
    exact_rows,
    g_test,
    law_identities,
    make_cells,
    ordered,
)
from qualification.distribution_rounds import (
    DistributionError,
    KernelRounds,
    MarkovCase,
    ReferenceRounds,
    markov_logits,
)
from reference.config import SamplingDefaults as SP
from reference.rejection import VerifyResult
from reference.rejection import verify as reference_verify
from reference.rng import Purpose, uniforms
from reference.sampling import draw, sample

BY_NAME = {c.name: c for c in CASES}
M = len(CASES)  # the CPU gate's Bonferroni m
ALPHA_M = 1e-3 / M


def exact_case(case: MarkovCase):
    impl = ReferenceRounds()
    target, draft = markov_logits(case)
    P, Q = impl.rows(case, target, draft)
    return exact_rows(P), exact_rows(Q)


# --- 1. the exact law ---------------------------------------------------------------------------
def naive_block_law(P, Q, x0: int, D: int):
    """From the definition, branch by branch: draft d ~ q̂, accept w.p. min(1, p̂/q̂), else the
    normalized residual; after D accepts the bonus from p̂."""
    V = len(P)
    out = defaultdict(Fr)

    def go(prev, j, prefix, pr):
        p, q = P[prev], Q[prev]
        if j == D:
            for t in range(V):
                out[prefix + (t,)] += pr * p[t]
            return
        res = [max(Fr(0), a - b) for a, b in zip(p, q, strict=True)]
        z = sum(res)
        for d in range(V):
            if q[d] == 0:
                continue
            a = min(Fr(1), p[d] / q[d])
            go(d, j + 1, prefix + (d,), pr * q[d] * a)
            for t in range(V):
                if z:
                    out[prefix + (t,)] += pr * q[d] * (1 - a) * res[t] / z

    go(x0, 0, (), Fr(1))
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("name", ["d1-plain", "d2-topk3", "d3-topp0.8", "d4-topk-topp", "d5-all"])
def test_block_law_equals_the_definition(name):
    case = BY_NAME[name]
    P, Q = exact_case(case)
    assert block_law(P, Q, case.x0, case.depth) == naive_block_law(P, Q, case.x0, case.depth)


@pytest.mark.slow
def test_case_matrix_covers_the_brief():
    depths = {c.depth for c in CASES}
    assert {1, 2, 3, 5, 7} <= depths
    kinds = {(c.params.temperature != 1.0, c.params.top_k < c.vocab, c.params.top_p < 1.0)
             for c in CASES}
    assert {(True, False, False), (False, True, False), (False, False, True)} <= kinds
    assert (True, True, True) in kinds  # the combination
    gaps = 0
    for case in CASES:
        assert 4 <= case.vocab <= 6
        P, Q = exact_case(case)
        law = block_law(P, Q, case.x0, case.depth)
        assert law_identities(P, Q, case.x0, case.depth, law) == [], case.name
        bonus = sum(m for k, m in law.items() if len(k) == case.depth + 1)
        assert Fr(1, 20) <= bonus <= Fr(19, 20), (case.name, float(bonus))
        gaps += any(p > 0 and q == 0 for a, b in zip(P, Q, strict=True)
                    for p, q in zip(a, b, strict=True))
    assert gaps >= 2  # tokens only the residual can emit (draft top-k/top-p cut them)


EXACT_MATCH = Rule(accept=lambda p, q, d: p[d])  # accept iff the target's own sample equals d
MUTANT_RULES = {
    "acceptance_by_exact_match": EXACT_MATCH,
    "ratio_inverted": Rule(accept=lambda p, q, d: min(Fr(1), q[d] / p[d]) if p[d] else Fr(0)),
    "replacement_from_p": Rule(replacement=lambda p, q: list(p)),
    "bonus_after_rejection": Rule(bonus_after_rejection=True),
}


@pytest.mark.parametrize("name", ["d2-temp0.7", "d3-topp0.8", "d7-topp0.9"])
def test_identities_break_under_planted_rules(name):
    case = BY_NAME[name]
    P, Q = exact_case(case)
    assert law_identities(P, Q, case.x0, case.depth, block_law(P, Q, case.x0, case.depth)) == []
    for rule_name, rule in MUTANT_RULES.items():
        bad = law_identities(P, Q, case.x0, case.depth,
                             block_law(P, Q, case.x0, case.depth, rule))
        assert any("horizon" in b for b in bad), rule_name
        # a bonus after a rejection leaves the first token alone: only the horizon sees it
        assert any("first" in b for b in bad) == (rule_name != "bonus_after_rejection"), rule_name


# --- 2. cells and statistics --------------------------------------------------------------------
def test_codes_round_trip_and_lengths_never_collide():
    V = 4
    blocks = [(0,), (0, 0), (3, 2, 1), (0, 0, 0, 0, 0, 0, 0, 0), (3,) * 8]
    codes = [encode_tuple(b, V) for b in blocks]
    assert len(set(codes)) == len(blocks)
    assert [decode(c, V) for c in codes] == blocks
    t = torch.tensor([list(b) + [7] * (8 - len(b)) for b in blocks])  # garbage past the length
    assert encode(t, torch.tensor([len(b) for b in blocks]), V).tolist() == codes


def test_cells_g_statistic_and_noncentrality_match_scipy():
    case = BY_NAME["d2-temp0.7"]
    codes, probs = ordered(block_law(*exact_case(case), case.x0, case.depth), case.vocab)
    lam = Noncentrality(ALPHA_M, 0.99)
    n, cells = choose_n(codes, probs, 0.01, lam)
    assert cells.pooled_mass > 0 and min(cells.probs) * n >= 5
    assert choose_n(codes, probs, 0.01, lam)[0] == n  # deterministic
    df = np.array([1, 7, cells.df])
    crit = stats.chi2.isf(ALPHA_M, df)
    assert np.allclose(stats.ncx2.sf(crit, df, lam(df)), 0.99, atol=1e-6)
    # draws from the exact law: the G statistic equals scipy's log-likelihood power divergence
    g = torch.Generator().manual_seed(3)
    idx = torch.multinomial(torch.tensor(probs), 50_000, replacement=True, generator=g)
    draws = codes[idx]
    small = make_cells(codes, probs, 50_000, lam)
    res = g_test(draws, small)
    kept = {c: i for i, c in enumerate(small.codes.tolist())}
    obs = np.zeros(len(small.probs))
    for c in draws.tolist():
        obs[kept.get(c, len(kept))] += 1
    want = stats.power_divergence(obs, 50_000 * small.probs, lambda_="log-likelihood")
    assert res.g == pytest.approx(want.statistic, rel=1e-9)
    assert res.p_value == pytest.approx(want.pvalue, rel=1e-6)
    assert res.impossible == 0
    bad = g_test(torch.cat([draws, torch.tensor([encode_tuple((0, 0, 0, 0), case.vocab)])]), small)
    assert bad.impossible == 1 and bad.p_value == 0.0


def test_half_split_is_the_least_favourable_perturbation():
    rng = np.random.default_rng(0)
    pi = rng.dirichlet(np.ones(30))
    t = 0.01
    for _ in range(200):  # random perturbations scaled to TV t: Σ δ²/π ≥ 4t²
        d = rng.normal(size=30) * pi
        d -= pi * d.sum()
        d *= 2 * t / np.abs(d).sum()
        assert np.sum(d**2 / pi) >= 4 * t**2 * (1 - 1e-12)
    s = np.where(np.arange(30) % 2 == 0, 1.0, -1.0)  # two halves, scaled to mass 1/2 each
    half = pi * np.where(s > 0, 0.5 / pi[s > 0].sum(), 0.5 / pi[s < 0].sum())
    d = 2 * t * s * half
    assert np.sum(d**2 / half) == pytest.approx(4 * t**2)


# --- 3. power, empirically ----------------------------------------------------------------------
def split(probs: np.ndarray) -> tuple[int, float]:
    """A = the most probable outcomes up to cumulative mass nearest 1/2: (its size, its mass)."""
    cdf = np.cumsum(probs)
    a = int(np.argmin(np.abs(cdf - 0.5)))
    return a + 1, float(cdf[a])


def tilted_draws(codes, probs, n: int, seed: int, tv: float) -> torch.Tensor:
    """Exact-law sampler: inverse CDF with Philox uniforms. tv > 0 bends the uniform so that mass
    tv moves from B to A, each outcome in proportion to its probability (TV = tv exactly)."""
    cdf = np.cumsum(probs)
    _, pa = split(probs)
    u = uniforms(seed, torch.arange(n, dtype=torch.int64), Purpose.TARGET_SAMPLE).double().numpy()
    if tv:
        u = np.where(u < pa + tv, u * pa / (pa + tv), pa + (u - pa - tv) * (1 - pa) / (1 - pa - tv))
    idx = np.minimum(np.searchsorted(cdf, u, side="right"), len(codes) - 1)
    return codes[torch.from_numpy(idx)]


def predicted_power(codes, probs, cells, n: int, tv: float) -> float:
    """ncx2 power of the G-test against the tilted law (its own λ over the cells)."""
    k, pa = split(probs)
    tilted = probs * np.where(np.arange(len(probs)) < k, (pa + tv) / pa, (1 - pa - tv) / (1 - pa))
    kept = len(cells.codes)  # the kept cells are the most probable outcomes, in order
    q = np.concatenate([tilted[:kept], [tilted[kept:].sum()] if cells.pooled_mass else []])
    lam = n * np.sum((q - cells.probs) ** 2 / cells.probs)
    return float(stats.ncx2.sf(stats.chi2.isf(ALPHA_M, cells.df), cells.df, lam))


@pytest.mark.slow
def test_planted_tv_bias_is_detected_and_the_exact_law_is_not_rejected():
    case = BY_NAME["d5-all"]  # 110 cells and a pooled cell at the gate's N
    codes, probs = ordered(block_law(*exact_case(case), case.x0, case.depth), case.vocab)
    lam = Noncentrality(ALPHA_M, 0.99)
    n, cells = choose_n(codes, probs, 0.01, lam)  # the N the gate uses when nothing is audited
    assert cells.pooled_mass > 0
    assert 0.99 <= predicted_power(codes, probs, cells, n, 0.01) < 0.995  # near least favourable
    reps = 40
    fair = [g_test(tilted_draws(codes, probs, n, 1000 + r, 0.0), cells).p_value
            for r in range(reps)]
    bias = [g_test(tilted_draws(codes, probs, n, 2000 + r, 0.01), cells).p_value
            for r in range(2 * reps)]
    assert sum(p < ALPHA_M for p in fair) == 0
    # power >= 99% gives >= 4 misses in 80 w.p. < 1%; a 90%-power test gives <= 3 w.p. ~4%
    misses = sum(p >= ALPHA_M for p in bias)
    assert misses <= 3, misses
    # the check can fail: at N/2 the same tilt is detected about as often as ncx2 predicts (~47%)
    n2 = n // 2
    c2 = make_cells(codes, probs, n2, lam)
    hits = sum(g_test(tilted_draws(codes, probs, n2, 3000 + r, 0.01), c2).p_value < ALPHA_M
               for r in range(reps))
    predicted = predicted_power(codes, probs, c2, n2, 0.01)
    print(f"N={n}: {misses}/{2 * reps} missed; N/2: {hits}/{reps} detected, ncx2 {predicted:.2f}")
    assert hits <= 0.75 * reps and abs(hits / reps - predicted) <= 0.2, (hits, predicted)


# --- 4. the real path ---------------------------------------------------------------------------
@pytest.mark.slow
def test_reference_passes_at_full_power_and_reruns_identically():
    cfg = DistributionConfig(cases=(BY_NAME["d3-topp0.8"],), tests=M, audit=1000)
    a = run_case(cfg.cases[0], ReferenceRounds(), cfg, keep_draws=True)
    assert a.ok, a.line()
    assert a.power_required and a.detectable <= 0.01 and a.audit == 1000 and not a.audit_bad
    b = run_case(cfg.cases[0], ReferenceRounds(), cfg, keep_draws=True)
    assert torch.equal(a.draws, b.draws) and a.test == b.test and a.n == b.n
    assert a.line().rsplit(";", 1)[0] == b.line().rsplit(";", 1)[0]  # all but the run time


# the five mutants live in negative_controls/ (one definition for the tests and for
# `nox -s negative_controls`)
MUTANTS = rejection_controls.MUTANTS


@pytest.mark.parametrize("mutant", list(MUTANTS))
@pytest.mark.slow
def test_mutants_fail_the_gate(mutant):
    name, impl = MUTANTS[mutant]
    # audit off: the G-test alone must reject (with the audit on, the replay would also differ)
    cfg = DistributionConfig(cases=(BY_NAME[name],), impls=(impl,), tests=M, audit=0)
    out = run(cfg)
    r = out.results[0]
    assert not out.ok and r.test.p_value < ALPHA_M, r.line()


def verify_replacement_from_p(p, q, drafts, seed, first):
    """reference.rejection.verify with the replacement drawn from p (a one-round mutant)."""
    res = reference_verify(p, q, drafts, seed, first)
    if res.bonus:
        return res
    j = res.n_accepted
    u = uniforms(seed, torch.tensor([first + j]), Purpose.TARGET_SAMPLE)
    return VerifyResult(j, int(draw(p[j : j + 1], u)[0]), False)


@pytest.mark.slow
def test_audit_catches_a_mutated_verify_the_batched_path_does_not_use():
    case = BY_NAME["d3-topp0.8"]
    cfg = DistributionConfig(cases=(case,), tests=M, n=4000, audit=300)
    r = run_case(case, ReferenceRounds(verifier=verify_replacement_from_p), cfg)
    assert r.test.p_value >= ALPHA_M  # the batched twin is unchanged ...
    assert r.audit_bad and not r.ok  # ... but verify no longer matches it
    assert run_case(case, ReferenceRounds(), cfg).ok


def test_draft_rows_must_be_a_function_of_the_previous_token():
    def positional_q(logits, params, seed, positions):
        tok, q = sample(logits, params, seed, positions, Purpose.DRAFT_SAMPLE)
        return tok, torch.roll(q, int(positions[0] % 2), dims=1)

    case = BY_NAME["d2-topk3"]
    cfg = DistributionConfig(cases=(case,), tests=M, n=2000, audit=0)
    with pytest.raises(DistributionError, match="function of the previous token"):
        run_case(case, ReferenceRounds(draft=positional_q), cfg)


def test_bad_cases_and_configs_raise_named_errors():
    with pytest.raises(DistributionError, match="depth"):
        MarkovCase("x", 4, 8, SP(1.0, 4, 1.0)).validate()
    with pytest.raises(DistributionError, match="top_k"):
        MarkovCase("x", 4, 2, SP(1.0, 0, 1.0)).validate()
    with pytest.raises(DistributionError, match="temperature"):
        MarkovCase("x", 4, 2, SP(0.0, 4, 1.0)).validate()
    with pytest.raises(DistributionError, match="audit"):
        run_case(CASES[0], ReferenceRounds(), DistributionConfig(audit=100))


@pytest.mark.slow
def test_kernel_smoke_under_the_interpreter_equals_the_reference():
    ok, lines = smoke(DistributionConfig(smoke=(("d3-topp0.8", 3),)))
    assert ok, lines


@pytest.mark.gpu
def test_kernel_path_passes_at_full_power_on_the_gpu():
    cfg = DistributionConfig(cases=CASES[:3], impls=(KernelRounds("cuda"),), tests=M)
    out = run(cfg)
    assert out.ok, out.evidence


def test_exact_match_rule_is_the_documented_mutant():
    """The rule-level exact-match mutant is the law of rejection_controls.exact_match_accept:
    P(accept d) = p̂(d)."""
    case = BY_NAME["d1-plain"]
    P, Q = exact_case(case)
    law = block_law(P, Q, case.x0, 1, EXACT_MATCH)
    p, q = P[case.x0], Q[case.x0]
    for d in range(case.vocab):
        for t in range(case.vocab):
            assert law.get((d, t), Fr(0)) == q[d] * p[d] * P[d][t]
    assert block_law(P, Q, case.x0, 1, STANDARD) != law
