"""Speculative-verification mutants, caught by gate 5 (rejection-sampling distribution): each
plants one defect in the reference verification path (qualification/distribution_rounds.py
hooks) and must make the emitted blocks' frequencies reject the exact block law."""

from __future__ import annotations

from dataclasses import replace

from negative_controls.control import Control
from qualification.distribution import CASES, DistributionConfig, run
from qualification.distribution_rounds import ReferenceRounds
from reference.rng import Purpose
from reference.sampling import draw, sample, served_distribution


def exact_match_accept(u, p, q, d):
    """Accept iff the target's own sample (drawn with the acceptance uniform) equals the draft."""
    return draw(p, u) == d


def inverted_accept(u, p, q, d):
    """Accept with min(1, q/p) instead of min(1, p/q)."""
    return u * p.gather(1, d[:, None])[:, 0] < q.gather(1, d[:, None])[:, 0]


def draft_q_at_t1(logits, params, seed, positions):
    """The draft samples at the request temperature but reports q at temperature 1."""
    tok, _ = sample(logits, params, seed, positions, Purpose.DRAFT_SAMPLE)
    return tok, served_distribution(logits, replace(params, temperature=1.0))


def replacement_from_p(p, q):
    """The replacement at the first rejection is drawn from p instead of norm(max(0, p − q))."""
    return p.clone()


MUTANTS = {  # name → (case, implementation with the defect)
    "acceptance_by_exact_match": ("d3-topp0.8", ReferenceRounds(accept=exact_match_accept)),
    "replacement_from_p": ("d3-topp0.8", ReferenceRounds(residual=replacement_from_p)),
    "bonus_after_rejection": ("d2-topk3", ReferenceRounds(bonus_after_rejection=True)),
    "draft_ignores_temperature": ("d2-temp0.7", ReferenceRounds(draft=draft_q_at_t1)),
    "ratio_inverted": ("d3-topp0.8", ReferenceRounds(accept=inverted_accept)),
}
_DESCRIPTIONS = {
    "acceptance_by_exact_match": "a draft is accepted only when the target's own sample equals "
    "it (exact match at T > 0) instead of with probability min(1, p/q)",
    "replacement_from_p": "the replacement token is drawn from p instead of norm(max(0, p − q))",
    "bonus_after_rejection": "a bonus token is emitted after a rejection as well",
    "draft_ignores_temperature": "the draft reports its distribution at temperature 1 while "
    "sampling at the request temperature",
    "ratio_inverted": "acceptance uses min(1, q/p)",
}


def _gate(name: str):
    case_name, impl = MUTANTS[name]
    case = next(c for c in CASES if c.name == case_name)

    def run_gate(mutated: bool):
        # the G-test alone must reject: the audit (replay through reference.rejection.verify)
        # is switched off, since it would flag the mutated twin by itself
        cfg = DistributionConfig(
            cases=(case,),
            impls=(impl if mutated else ReferenceRounds(),),
            tests=len(CASES),
            audit=0,
        )
        out = run(cfg)
        return out.ok, out.evidence[1:2]

    return run_gate


CONTROLS = tuple(
    Control(name, "5 rejection-sampling distribution", _DESCRIPTIONS[name], _gate(name))
    for name in MUTANTS
)
