"""Gate 5, the implementations under test: one speculative round per trial on a Markov case.

Dimension letters: n trials (rounds) of one seed block, V vocabulary, D drafts per round,
W served width of a kernel row.

A case is a Markov target and draft on V tokens (each row's logits follow the previous token, as
with a recursive draft; different tables), both served with the case's temperature / top-k /
top-p (top_k = V means off). A trial is one round from the committed token x0 at first position
f: D drafts (DRAFT_SAMPLE at f … f+D−1), then verification (ACCEPT at f … f+D−1, TARGET_SAMPLE
at f … f+D), returned as the code of the emitted block (distribution_law.encode).

  ReferenceRounds — the drafts by reference.sampling.sample, batched over the n trials; the
    verification by a batched twin of reference.rejection.verify built from its parts
    (reference.rng.uniforms, decide()'s acceptance line fl(u·q[d]) < p[d],
    reference.rejection.residual_distribution, reference.sampling.draw). `audit` replays trials
    through reference.rejection.verify itself; the gate requires identical blocks.
  KernelRounds — kernels.sampler.sample for the drafts (batched rows) and the target rows,
    kernels.verify.verify_batch (every round in one launch; program b is the production
    one-round kernel with round b's rows and position, tests/kernels/test_verify_batch.py).
Both check that the draft's served rows are a function of the previous token, so that the exact
law can be computed from one row per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from qualification.distribution_law import decode, encode
from reference.config import SamplingDefaults as SP
from reference.rejection import residual_distribution
from reference.rejection import verify as reference_verify
from reference.rng import Purpose, uniforms
from reference.sampling import draw, sample, served_distribution


class DistributionError(ValueError):
    """A bad case or configuration; the message names it."""


@dataclass(frozen=True)
class MarkovCase:
    name: str
    vocab: int  # V in [2, 8]
    depth: int  # D in [1, 7]
    params: SP  # target and draft sampling; temperature > 0, 1 <= top_k <= V (V = off)
    x0: int = 0  # committed token before the round
    table_seed: int = 0
    target_scale: float = 2.0  # target logits ~ N(0, scale^2)
    draft_noise: float = 0.8  # draft logits = target + N(0, noise^2)

    def validate(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise DistributionError(f"case {self.name!r}: {what}")

        need(2 <= self.vocab <= 8, f"vocab must be in [2, 8], got {self.vocab}")
        need(1 <= self.depth <= 7, f"depth must be in [1, 7], got {self.depth}")
        need(0 <= self.x0 < self.vocab, f"x0 must be in [0, {self.vocab}), got {self.x0}")
        need(self.params.temperature > 0, "temperature must be > 0 (greedy has no law to test)")
        need(1 <= self.params.top_k <= self.vocab, f"top_k must be in [1, V={self.vocab}]")
        need(0 < self.params.top_p <= 1, f"top_p must be in (0, 1], got {self.params.top_p}")

    def describe(self) -> str:
        p = self.params
        return (f"V={self.vocab} D={self.depth} T={p.temperature} k={p.top_k} p={p.top_p} "
                f"x0={self.x0}")


def markov_logits(case: MarkovCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(target [V(prev), V], draft [V(prev), V]) fp32 logits; row c follows token c."""
    case.validate()
    V = case.vocab
    g = torch.Generator().manual_seed(case.table_seed)
    target = torch.randn(V, V, generator=g) * case.target_scale
    return target, target + torch.randn(V, V, generator=g) * case.draft_noise


class Batch(NamedTuple):
    codes: torch.Tensor  # [n] int64 emitted-block codes (distribution_law.encode)
    drafts: torch.Tensor  # [n, D] int64
    q: torch.Tensor  # [n, D, V] fp32 the draft's served rows, as verify receives them
    ctx: torch.Tensor  # [n, D+1] int64: the token each target row follows (x0, drafts)


def reference_draft(logits, params, seed, positions):
    """(tokens [n], served q [n, V]) for logits [n, V]: reference.sampling.sample."""
    return sample(logits, params, seed, positions, Purpose.DRAFT_SAMPLE)


def accept_ratio(u, p, q, d):
    """u [n], p / q [n, V], d [n] → accept [n]: decide()'s fl(u·q[d]) < p[d] (u < min(1, p/q))."""
    return u * q.gather(1, d[:, None])[:, 0] < p.gather(1, d[:, None])[:, 0]


@dataclass(frozen=True)
class ReferenceRounds:
    """The reference path, batched over trials; tests plant defects through the hooks."""

    name: str = "reference"
    draft: Callable = reference_draft
    accept: Callable = accept_ratio
    residual: Callable = residual_distribution  # (p [V], q [V]) -> [V]
    bonus_after_rejection: bool = False
    verifier: Callable = reference_verify  # the audit's one-round path

    def rows(self, case, target, draft):
        """(P [V, V], Q [V, V]): the served rows the verifier sees, by context token."""
        V = case.vocab
        return served_distribution(target, case.params), self.draft(
            draft, case.params, 0, torch.arange(V))[1]

    def run(self, case, target, draft, P, Q, seed, first) -> Batch:
        n, D, V = first.numel(), case.depth, case.vocab
        prev = torch.full((n,), case.x0, dtype=torch.int64)
        drafts = torch.empty(n, D, dtype=torch.int64)
        qs = torch.empty(n, D, V)
        for j in range(D):
            tok, q = self.draft(draft[prev], case.params, seed, first + j)
            if not torch.equal(q, Q[prev]):
                raise DistributionError(f"{self.name}: the draft's served rows are not a "
                                        "function of the previous token")
            drafts[:, j], qs[:, j], prev = tok, q, tok
        ctx = torch.cat([torch.full((n, 1), case.x0), drafts], 1)  # [n, D+1]
        R = torch.stack([self.residual(P[c], Q[c]) for c in range(V)])  # [V, V] by context
        ua = torch.stack([uniforms(seed, first + j, Purpose.ACCEPT) for j in range(D)], 1)
        us = torch.stack([uniforms(seed, first + j, Purpose.TARGET_SAMPLE)
                          for j in range(D + 1)], 1)  # [n, D+1]
        k = torch.full((n,), D)  # accepted drafts
        alive = torch.ones(n, dtype=torch.bool)
        for j in range(D):
            ok = self.accept(ua[:, j], P[ctx[:, j]], qs[:, j], drafts[:, j])
            k = torch.where(alive & ~ok, j, k)
            alive &= ok
        last = ctx.gather(1, k[:, None])[:, 0]  # the token the final row follows
        tok = draw(torch.where(alive[:, None], P[last], R[last]), us.gather(1, k[:, None])[:, 0])
        block = torch.cat([drafts, torch.zeros(n, 2, dtype=torch.int64)], 1)  # [n, D+2]
        block[torch.arange(n), k] = tok
        length = k + 1
        if self.bonus_after_rejection:
            rej = torch.nonzero(~alive)[:, 0]
            row = P[drafts[rej, k[rej]]]  # the target row after the rejected draft
            b = draw(row, us[rej, k[rej] + 1]) if len(rej) else rej
            block[rej, k[rej] + 1] = b
            length[rej] += 1
        return Batch(encode(block, length, V), drafts, qs, ctx)

    def audit(self, case, P, batch: Batch, seed, first, count: int) -> list[str]:
        """Trials 0 … count−1 replayed through `verifier`: the differing ones."""
        bad = []
        for i in range(min(count, first.numel())):
            want = decode(int(batch.codes[i]), case.vocab)
            try:
                res = self.verifier(P[batch.ctx[i]], batch.q[i], batch.drafts[i], seed,
                                    int(first[i]))
                got = tuple(res.emitted(batch.drafts[i]))
            except ValueError as e:
                got = f"error: {e}"
            if got != want:
                bad.append(f"trial {i} (seed {seed}, position {int(first[i])}): verify emitted "
                           f"{got}, batched path {want}")
        return bad


@dataclass(frozen=True)
class KernelRounds:
    """kernels.sampler.sample per draft depth + kernels.verify.verify_batch (one launch for all
    rounds; each program is the one-round kernel, tests/kernels/test_verify_batch.py)."""

    device: str = "cuda"
    name: str = "kernel"

    def _served(self, logits, params, seed, purpose):
        from kernels.sampler import sample as ksample

        V = logits.shape[0]
        return ksample(logits.to(self.device).contiguous(), params, seed,
                       torch.arange(V, device=self.device), purpose)

    def rows(self, case, target, draft):
        from reference.twins.verify import densify

        V = case.vocab
        t = self._served(target, case.params, 0, Purpose.TARGET_SAMPLE)
        d = self._served(draft, case.params, 0, Purpose.DRAFT_SAMPLE)
        return densify(t.ids.cpu(), t.probs.cpu(), V), densify(d.ids.cpu(), d.probs.cpu(), V)

    def run(self, case, target, draft, P, Q, seed, first) -> Batch:
        from kernels.sampler import sample as ksample
        from kernels.verify import verify_batch

        dev, n, D, V = self.device, first.numel(), case.depth, case.vocab
        f = first.to(dev)
        tp = self._served(target, case.params, seed, Purpose.TARGET_SAMPLE)  # [V, W] rows
        qrow = self._served(draft, case.params, seed, Purpose.DRAFT_SAMPLE)
        dl = draft.to(dev)
        prev = torch.full((n,), case.x0, dtype=torch.int64, device=dev)
        drafts = torch.empty(n, D, dtype=torch.int64, device=dev)
        W = qrow.ids.shape[1]
        qi = torch.empty(n, D, W, dtype=torch.int64, device=dev)
        qp = torch.empty(n, D, W, device=dev)
        for j in range(D):
            o = ksample(dl[prev].contiguous(), case.params, seed, f + j, Purpose.DRAFT_SAMPLE)
            if not (torch.equal(o.ids, qrow.ids[prev]) and torch.equal(o.probs, qrow.probs[prev])):
                raise DistributionError("kernel: the draft's served rows are not a function of "
                                        "the previous token")
            drafts[:, j], qi[:, j], qp[:, j] = o.tokens, o.ids, o.probs
            prev = o.tokens
        ctx = torch.cat([torch.full((n, 1), case.x0, device=dev), drafts], 1)  # [n, D+1]
        pi, pp = tp.ids[ctx].contiguous(), tp.probs[ctx].contiguous()  # [n, D+1, W]
        emitted = verify_batch(pi, pp, qi, qp, drafts, seed, f).emitted.cpu()  # [n, D+1]
        drafts = drafts.cpu()
        q = Q[ctx[:, :D].cpu()]  # [n, D, V]
        codes = encode(emitted.clamp(min=0), (emitted >= 0).sum(1), V)
        return Batch(codes, drafts, q, ctx.cpu())

    def audit(self, case, P, batch, seed, first, count) -> list[str]:
        return []
