"""Speculative rejection sampling relative to the served distributions.

Dimension letters: D drafts in this round, V vocabulary.

p [D+1, V]: the target's served rows (sampling.served_distribution) for positions
first_position … first_position + D; row j is conditioned on the drafts before j.
q [D, V]: the draft's served rows, the distributions drafts[j] was actually drawn from.
drafts[j] is the token proposed for position first_position + j.

For j = 0 … D-1 (stop at the first rejection):
  accept drafts[j] = d  iff  u_acc · q[j, d] < p[j, d]   (fp32 product, strict <)
    with u_acc = uniforms(seed, first_position + j, ACCEPT). This is u < min(1, p/q) written
    without a division: no rounding of p/q, and the min is implicit because u < 1.
  at the first rejection the token at first_position + j is
    draw(residual_distribution(p[j], q[j]), uniforms(seed, first_position + j, TARGET_SAMPLE)).
If all D are accepted, the bonus token at first_position + D is
  draw(p[D], uniforms(seed, first_position + D, TARGET_SAMPLE)).
With D = 0 this is plain sampling: bit-identical to sampling.sample at that position.

residual_distribution(p, q) = norm(max(0, p − q)): fp32 subtraction, Z = sequential fp32 sum in
index order, r = d / Z. If Z == 0 it is defined as p. With exact probabilities Z = 0 means
p == q, where rejection has probability 0; with fp32 rows (Σp ≠ Σq by rounding) p ≤ q
elementwise can leave a rejection mass of order 1e-7, and p is then the natural answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.rng import MASK32, Purpose, uniforms
from reference.sampling import SamplingError, check_probs, draw, seq_cumsum


@dataclass(frozen=True)
class VerifyResult:
    n_accepted: int  # drafts accepted, 0 … D
    next_token: int  # the replacement (first rejection) or the bonus token (all accepted)
    bonus: bool  # True when all D drafts were accepted and next_token came from p[D]

    def emitted(self, drafts: torch.Tensor) -> list[int]:
        """The tokens this round commits: accepted drafts, then next_token."""
        return [int(t) for t in drafts[: self.n_accepted]] + [self.next_token]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[V] fp32: norm(max(0, p − q)), or p when that mass is 0."""
    for name, t in (("p", p), ("q", q)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
            raise SamplingError(f"residual_distribution: {name} must be a 1-D float32 tensor")
    if p.shape != q.shape:
        raise SamplingError(f"residual_distribution: p {tuple(p.shape)} != q {tuple(q.shape)}")
    check_probs(p[None], "residual_distribution p")
    check_probs(q[None], "residual_distribution q")
    d = torch.clamp_min(p - q, 0.0)  # [V]
    z = seq_cumsum(d[None])[0, -1]
    return p.clone() if z == 0 else d / z


def _check_round(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> int:
    if not isinstance(drafts, torch.Tensor) or drafts.dtype != torch.int64 or drafts.dim() != 1:
        raise SamplingError("verify: drafts must be a 1-D int64 tensor [D]")
    D = drafts.shape[0]
    check_probs(p, "verify p")
    if p.shape[0] != D + 1:
        raise SamplingError(f"verify: p must have D+1={D + 1} rows, got {p.shape[0]}")
    V = p.shape[1]
    if D:
        check_probs(q, "verify q")
    elif not (isinstance(q, torch.Tensor) and q.dtype == torch.float32):
        raise SamplingError("verify q: must be a float32 tensor")
    if q.shape != (D, V):
        raise SamplingError(f"verify: q must be [D={D}, V={V}], got {tuple(q.shape)}")
    if D and (int(drafts.min()) < 0 or int(drafts.max()) >= V):
        raise SamplingError(f"verify: drafts must lie in [0, V={V}), got {drafts.tolist()}")
    for j in range(D):
        if q[j, drafts[j]] == 0:
            raise SamplingError(
                f"verify: drafts[{j}]={int(drafts[j])} has q[{j}]=0; q must be the "
                "distribution the draft actually sampled from"
            )
    return D


def decide(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> VerifyResult:
    """The verification rule for given uniforms u_accept [D] and u_sample [D+1] (fp32)."""
    D = _check_round(p, q, drafts)
    for name, u, n in (("u_accept", u_accept, D), ("u_sample", u_sample, D + 1)):
        if not isinstance(u, torch.Tensor) or u.dtype != torch.float32 or u.shape != (n,):
            raise SamplingError(f"verify: {name} must be float32 [{n}]")
    for j in range(D):
        d = int(drafts[j])
        if not u_accept[j] * q[j, d] < p[j, d]:
            r = residual_distribution(p[j], q[j])
            return VerifyResult(j, int(draw(r[None], u_sample[j : j + 1])[0]), False)
    return VerifyResult(D, int(draw(p[D : D + 1], u_sample[D:])[0]), True)


def verify(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, seed: int, first_position: int
) -> VerifyResult:
    """One round's acceptance with the counter-based uniforms of (seed, position)."""
    D = _check_round(p, q, drafts)
    if isinstance(first_position, bool) or not isinstance(first_position, int):
        raise SamplingError(f"verify: first_position must be an int, got {first_position!r}")
    if not (0 <= first_position and first_position + D <= MASK32):
        raise SamplingError(
            f"verify: positions {first_position}…{first_position + D} must lie in [0, 2^32)"
        )
    pos = first_position + torch.arange(D + 1, dtype=torch.int64)  # [D+1]
    u_accept = uniforms(seed, pos[:D], Purpose.ACCEPT)  # [D]
    u_sample = uniforms(seed, pos, Purpose.TARGET_SAMPLE)  # [D+1]
    return decide(p, q, drafts, u_accept, u_sample)
