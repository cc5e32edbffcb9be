"""Gate 5 — rejection sampling preserves the target law, tested as a hypothesis.

The case matrix (Markov target and draft, distribution_rounds.py), the exact block law and the
G-test with its power (distribution_law.py): for each (implementation, case), N is the least that
gives ≥ 99% least-favourable power at total variation 0.01 over all block outcomes, at α/m
(α = 1e-3 family-wise, Bonferroni over the m tests of the run).

Trials and seeds: block b of case c uses the Philox seed `base + 2^20·crc32(c) + b` (blocks of
`block` trials); trial k of a block is a round at first position 100 + k·(D + 1): it consumes
DRAFT_SAMPLE, ACCEPT and TARGET_SAMPLE at positions 100 + k(D+1) … + D exactly as a real round
there, and distinct trials never share a counter. Everything is fixed: reruns give the same draws.

The reference path is a batched twin audited against reference.rejection.verify on the first
`audit` trials of each case (identical blocks required). If verify's law were ≥ 0.01 from the
exact law, either the twin differs from verify on a share ε ≥ ln(100)/audit of rounds (the audit
misses that with probability ≤ 1%), or the twin's law is ≥ 0.01 − ε from the exact law, and the
G-test's N is chosen for ≥ 99% power at that TV: the 99% claim at TV 0.01 holds for verify itself.
The kernel path is sampled directly; on the CPU (interpreter) only as a smoke run of a few rounds
that must lie in the exact law's support and equal the reference's blocks on the same counters —
no statistical claim is made for it there.

The exact law is computed from the rows the implementation serves to its verifier (P from the
target sampler, Q from the draft's own served rows): this gate tests the draft-and-verify rule
relative to them. Whether those rows follow the pinned temperature / top-k / top-p semantics is
gate 6 (sampler_gate.py); for the reference path they are reference.sampling by construction.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field

import torch

from qualification.distribution_law import (
    GTest,
    Noncentrality,
    block_law,
    choose_n,
    decode,
    detectable_tv,
    encode_tuple,
    exact_rows,
    g_test,
    law_identities,
    make_cells,
    ordered,
    power_at,
)
from qualification.distribution_rounds import (
    DistributionError,
    KernelRounds,
    MarkovCase,
    ReferenceRounds,
    markov_logits,
)
from reference.config import SamplingDefaults as SP

FIRST_POSITION = 100  # a committed prompt of 100 tokens
MIN_PATH = 0.05  # each case must end in a bonus and in a replacement with at least this chance


def _c(name, V, D, T, k, p, seed, scale=2.0, noise=0.8, x0=0) -> MarkovCase:
    return MarkovCase(name, V, D, SP(T, k, p), x0, seed, scale, noise)


# Temperature, top-k, top-p and their combinations over D = 1…7; every case ends in a bonus
# and in a replacement with probability >= MIN_PATH (tests/qualification/test_distribution_gate.py).
CASES: tuple[MarkovCase, ...] = (
    _c("d1-plain", 6, 1, 1.0, 6, 1.0, 11, noise=1.2),
    _c("d2-temp0.7", 6, 2, 0.7, 6, 1.0, 12, 2.0, 1.0, 2),
    _c("d3-temp1.5", 4, 3, 1.5, 4, 1.0, 13, 3.0),
    _c("d2-topk3", 6, 2, 1.0, 3, 1.0, 14, noise=1.2, x0=1),
    _c("d3-topp0.8", 5, 3, 1.0, 5, 0.8, 15),
    _c("d4-topk-topp", 5, 4, 1.2, 3, 0.9, 16, 2.5),
    _c("d5-all", 5, 5, 0.8, 4, 0.9, 17, x0=3),
    _c("d6-temp0.6", 4, 6, 0.6, 4, 1.0, 18, 2.0, 0.6),
    _c("d7-all", 4, 7, 0.9, 3, 0.95, 19, 2.5, 0.6),
    _c("d7-topp0.9", 4, 7, 1.0, 4, 0.9, 20, 2.0, 0.6, 1),
)
QUICK = ("d1-plain", "d3-topp0.8", "d7-all")


# --- the gate ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DistributionConfig:
    cases: tuple[MarkovCase, ...] = CASES
    impls: tuple = (ReferenceRounds(),)
    alpha: float = 1e-3  # family-wise, split over `tests` (Bonferroni)
    tests: int | None = None  # m; default len(cases)·len(impls)
    tv: float = 0.01
    power: float = 0.99
    n: int | None = None  # fixed N (a reduced run): power is then reported, not required
    audit: int = 2000  # reference trials replayed through reference.rejection.verify
    seed: int = 20260501
    block: int = 32768  # trials per Philox seed
    smoke: tuple[tuple[str, int], ...] = ()  # (case, rounds) of the kernel under the interpreter

    @property
    def m(self) -> int:
        return self.tests or len(self.cases) * len(self.impls)


@dataclass
class CaseResult:
    case: MarkovCase
    impl: str
    n: int
    alpha: float  # α/m
    test: GTest
    power: float  # least favourable, at TV `tv` (for verify itself when audited)
    detectable: float  # TV detected with the configured power (audit slack included)
    tv: float
    pooled: float
    p_bonus: float
    identities: list[str]
    audit: int
    audit_bad: list[str]
    power_required: bool
    seconds: float = 0.0
    draws: torch.Tensor = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return (not self.identities and not self.audit_bad and self.test.p_value >= self.alpha
                and (self.detectable <= self.tv or not self.power_required)
                and MIN_PATH <= self.p_bonus <= 1 - MIN_PATH)

    def line(self) -> str:
        c, t = self.case, self.test
        worst = "pool" if t.worst < 0 else str(decode(t.worst, c.vocab))
        parts = [
            f"{self.impl} {c.name} ({c.describe()}): N={self.n}, {t.df + 1} cells "
            f"(pooled {self.pooled:.1e}), G={t.g:.1f} df={t.df} p={t.p_value:.3g} vs "
            f"α/m={self.alpha:.1e}",
            f"power {self.power:.2%} at TV {self.tv}, detectable TV {self.detectable:.4f}"
            + ("" if self.power_required else " (reduced run: power not required)"),
            f"bonus {self.p_bonus:.2f} / replacement {1 - self.p_bonus:.2f}",
            f"worst cell {worst} z={t.worst_z:+.1f}",
        ]
        if t.impossible:
            parts.append(f"{t.impossible} draws outside the exact law's support")
        if self.audit:
            parts.append(f"audit vs reference.rejection.verify: "
                         f"{self.audit - len(self.audit_bad)}/{self.audit} identical")
        elif self.impl == "reference":
            parts.append("NOT audited: the claim covers the batched path only")
        parts.append("law identities exact" if not self.identities else "; ".join(self.identities))
        if not MIN_PATH <= self.p_bonus <= 1 - MIN_PATH:
            parts.append(f"INVALID CASE: bonus or replacement below {MIN_PATH}")
        return "; ".join(parts) + f"; {self.seconds:.1f}s"


def trial_seed(base: int, case: MarkovCase, block: int) -> int:
    return (base + (zlib.crc32(case.name.encode()) << 20) + block) % 2**64


def first_positions(case: MarkovCase, n: int) -> torch.Tensor:
    return FIRST_POSITION + torch.arange(n, dtype=torch.int64) * (case.depth + 1)  # [n]


def run_case(case: MarkovCase, impl, cfg: DistributionConfig, keep_draws=False) -> CaseResult:
    t0 = time.perf_counter()
    target, draft = markov_logits(case)
    P, Q = impl.rows(case, target, draft)
    Ph, Qh = exact_rows(P), exact_rows(Q)
    law = block_law(Ph, Qh, case.x0, case.depth)
    identities = law_identities(Ph, Qh, case.x0, case.depth, law)
    codes, probs = ordered(law, case.vocab)
    alpha = cfg.alpha / cfg.m
    lam = Noncentrality(alpha, cfg.power)
    audited = isinstance(impl, ReferenceRounds)
    audit = min(cfg.audit, cfg.block, cfg.n or cfg.block) if audited else 0
    slack = math.log(100) / audit if audit else 0.0  # a twin/verify difference the audit catches
    if cfg.n is None:
        if slack >= cfg.tv / 2:
            raise DistributionError(f"audit={audit}: ln(100)/audit must be < TV/2 = {cfg.tv / 2}")
        n, cells = choose_n(codes, probs, cfg.tv - slack, lam)
    else:
        n, cells = cfg.n, make_cells(codes, probs, cfg.n, lam)
    draws, audit_bad = [], []
    for b, start in enumerate(range(0, n, cfg.block)):
        seed = trial_seed(cfg.seed, case, b)
        first = first_positions(case, min(cfg.block, n - start))
        batch = impl.run(case, target, draft, P, Q, seed, first)
        if b == 0 and audit:
            audit_bad = impl.audit(case, P, batch, seed, first, audit)
        draws.append(batch.codes)
    draws = torch.cat(draws)
    return CaseResult(
        case, impl.name, n, alpha, g_test(draws, cells),
        power_at(cells, n, cfg.tv - slack, alpha) if slack < cfg.tv else 0.0,
        detectable_tv(cells, n, lam) + slack, cfg.tv, cells.pooled_mass,
        sum(float(m) for k, m in law.items() if len(k) == case.depth + 1), identities,
        audit, audit_bad, cfg.n is None, time.perf_counter() - t0,
        draws if keep_draws else None,
    )


def smoke(cfg: DistributionConfig) -> tuple[bool, list[str]]:
    """The kernel path under the interpreter: a few rounds, in the support and equal to the
    reference's blocks on the same counters. Not a statistical test."""
    ok, lines = True, []
    by_name = {c.name: c for c in CASES + cfg.cases}
    for name, rounds in cfg.smoke:
        case = by_name[name]
        target, draft = markov_logits(case)
        seed, first = trial_seed(cfg.seed, case, 0), first_positions(case, rounds)
        kern, ref = KernelRounds("cpu"), ReferenceRounds()
        kP, kQ = kern.rows(case, target, draft)
        got = kern.run(case, target, draft, kP, kQ, seed, first).codes
        want = ref.run(case, target, draft, *ref.rows(case, target, draft), seed, first).codes
        law = block_law(exact_rows(kP), exact_rows(kQ), case.x0, case.depth)
        support = {encode_tuple(k, case.vocab) for k in law}
        outside = sum(int(c) not in support for c in got)
        same = int((got == want).sum())
        ok &= outside == 0 and same == rounds
        lines.append(f"kernel smoke {name} under the interpreter (NOT a statistical test): "
                     f"{rounds} rounds, {outside} outside the support, {same}/{rounds} equal to "
                     "the reference on the same counters")
    return ok, lines


@dataclass
class GateOutcome:
    ok: bool
    margin: str
    evidence: list[str]
    results: list[CaseResult]


def run(cfg: DistributionConfig) -> GateOutcome:
    results = [run_case(c, impl, cfg) for impl in cfg.impls for c in cfg.cases]
    ok = all(r.ok for r in results)
    alpha = cfg.alpha / cfg.m
    worst = min(results, key=lambda r: r.test.p_value)
    detect = max(r.detectable for r in results)
    power = min(r.power for r in results)
    sizing = (f"N per case for ≥ {cfg.power:.0%} least-favourable power at TV {cfg.tv} over all "
              "block outcomes" if cfg.n is None else
              f"REDUCED RUN: N = {cfg.n} per case, the TV detected with {cfg.power:.0%} is stated")
    evidence = [
        f"α = {cfg.alpha:g} family-wise, Bonferroni over m = {cfg.m} tests → α/m = {alpha:.1e}; "
        f"{sizing} (cells: most probable outcomes alone, the rest pooled, expected ≥ 5)"
    ] + [r.line() for r in results]
    audits = {r.audit for r in results if r.audit}
    for a in sorted(audits):
        eps = math.log(100) / a
        evidence.insert(1, f"reference: the audit of {a} rounds catches a twin/verify difference "
                        f"on ≥ ln(100)/{a} = {eps:.4f} of rounds w.p. ≥ 99%; "
                        + (f"the G-test is sized for TV {cfg.tv - eps:.4f}" if cfg.n is None
                           else "the detectable TV below includes it"))
    if cfg.smoke:
        smoke_ok, lines = smoke(cfg)
        ok &= smoke_ok
        evidence += lines
    margin = (f"min p {worst.test.p_value:.3g} ({worst.case.name}) vs α/m {alpha:.1e}; "
              f"min power {power:.1%} at TV {cfg.tv} (TV ≥ {detect:.4f} detected w.p. "
              f"{cfg.power:.0%})")
    return GateOutcome(ok, margin, evidence, results)


def gate_config(quick: bool, gpu: bool) -> DistributionConfig:
    """CPU: the reference path on every case at full power, the kernel as a smoke run; quick: three
    cases at N = 40000 (detectable TV stated). GPU: the kernel path on every case at full power
    (the reference path is device independent and qualified by every CPU run)."""
    quick_cases = tuple(c for c in CASES if c.name in QUICK)
    if gpu:
        impls = (KernelRounds("cuda"),)
        return DistributionConfig(quick_cases, impls, n=40_000) if quick else DistributionConfig(
            impls=impls)
    if quick:
        return DistributionConfig(quick_cases, n=40_000, audit=500, smoke=(("d3-topp0.8", 4),))
    return DistributionConfig(smoke=(("d2-topk3", 12), ("d7-all", 6)))
