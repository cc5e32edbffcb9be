"""Pinned sampling semantics: temperature, top-k, top-p, and the inverse-CDF draw.

Dimension letters: R rows, V vocabulary, K kept candidates (K = top_k, or V when top_k = 0).

The served distribution of one row of fp32 logits under (temperature T, top_k k, top_p P):
  * T == 0: one-hot at the argmax (ties: lowest index); k and P are ignored.
  * z = logits / fp32(T)                            — fp32 division, not a reciprocal multiply.
  * top-k: keep the k largest z in the total order (z desc, index asc); k = 0 keeps all V.
  * softmax over the kept set only: m = max z; e = exp(z − m); S = Σ e summed sequentially in
    fp32 in that same (z desc, index asc) order; p = e / S.
  * top-p on the renormalized remainder: order the kept set by (p desc, index asc); c_j = the
    sequential fp32 running sum in that order; keep the shortest prefix whose c_j >= fp32(P)
    (the token that crosses P is kept). If no c_j reaches fp32(P) (rounding), keep them all;
    P == 1 keeps them all.
  * renormalize: S2 = sequential fp32 sum of the kept p in that order; served = p / S2 (always,
    also when nothing was cut, so a kernel has one code path). Dropped tokens get exactly 0.
The served candidates are reported in the draw order (served desc, index asc); renormalizing
can merge two distinct p into one served value, which is why the order is taken again.

draw(probs, u): the support is {probs > 0}, ordered (prob desc, index asc); Z = its sequential
fp32 sum, c_i its sequential fp32 running sums; the token is the first i with fl(u·Z) < c_i,
or the last support token if none (only fl rounding can leave u·Z ≥ Z).

Every sum is sequential fp32 in a stated order, so a kernel working on the <= K candidates can
reproduce the bits. The one operation not pinned to the bit is exp: here it is reference.ops.exp32
(FP64 exp rounded to FP32, the same bits on every CPU code path), while a kernel's tl.exp or
libdevice exp may differ by an ulp or a few; a kernel is compared to this reference after its own
exp, or with a tolerance row. Logits may hold -inf (masked tokens, probability 0) but not NaN or
+inf.
"""

from __future__ import annotations

import numpy as np
import torch

from reference.config import ConfigError, SamplingDefaults
from reference.ops import exp32
from reference.rng import Purpose, uniforms


class SamplingError(ValueError):
    """Bad logits, probabilities, uniforms or sampling parameters; the message names them."""


def seq_cumsum(x: torch.Tensor) -> torch.Tensor:
    """[R, N] fp32 → [R, N] fp32 with c[:, i] = fl(c[:, i-1] + x[:, i]), strictly left to right.

    torch.cumsum on CPU accumulates fp32 in double, so it does not give these bits;
    numpy's add.accumulate in float32 does (checked against a scalar loop in the tests).
    """
    a = x.detach().to(torch.float32).cpu().numpy()
    return torch.from_numpy(np.add.accumulate(a, axis=1, dtype=np.float32)).to(x.device)


def order_desc(vals: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Permutation [R, N] sorting each row by the total order (vals desc, ids asc)."""
    by_id = ids.argsort(dim=1, stable=True)  # [R, N]
    by_val = torch.sort(vals.gather(1, by_id), dim=1, descending=True, stable=True).indices
    return by_id.gather(1, by_val)


def check_params(params: SamplingDefaults, vocab: int) -> None:
    if not isinstance(params, SamplingDefaults):
        raise SamplingError(f"params must be a SamplingDefaults, got {type(params).__name__}")
    try:
        params.validate(vocab, where="sampling")
    except ConfigError as e:
        raise SamplingError(str(e)) from None


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32:
        raise SamplingError("logits must be a float32 tensor")
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise SamplingError(f"logits must be [R, V] with V >= 1, got {tuple(logits.shape)}")
    if torch.isnan(logits).any() or (logits == float("inf")).any():
        raise SamplingError("logits contain NaN or +inf")
    if logits.shape[0] and not torch.isfinite(logits).any(dim=1).all():
        raise SamplingError("a row of logits is all -inf (no token can be served)")


def served_candidates(
    logits: torch.Tensor, params: SamplingDefaults
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [R, K] int64, served [R, K] fp32) in draw order; dropped candidates have 0."""
    _check_logits(logits)
    R, V = logits.shape
    check_params(params, V)
    pos = torch.arange(V, device=logits.device).expand(R, V)  # [R, V]
    if params.temperature == 0.0:
        top = order_desc(logits, pos)[:, :1]  # [R, 1] argmax, lowest index on ties
        return top, torch.ones(R, 1, dtype=torch.float32, device=logits.device)
    z = logits / torch.tensor(params.temperature, dtype=torch.float32)  # [R, V]
    if (z == float("inf")).any():
        raise SamplingError(
            f"sampling.temperature={params.temperature}: logits / temperature overflows fp32"
        )
    k = params.top_k or V
    perm = order_desc(z, pos)[:, :k]  # [R, K] (z desc, index asc)
    zk = z.gather(1, perm)  # [R, K]
    e = exp32(zk - zk[:, :1])  # [R, K]
    p = e / seq_cumsum(e)[:, -1:]  # [R, K]
    again = order_desc(p, perm)  # [R, K] (p desc, index asc)
    ids, p = perm.gather(1, again), p.gather(1, again)
    if params.top_p < 1.0:
        crossed = seq_cumsum(p) >= torch.tensor(params.top_p, dtype=torch.float32)  # [R, K]
        before = crossed.to(torch.int64).cumsum(1) - crossed.to(torch.int64)  # crossings < j
        p = torch.where(before == 0, p, torch.zeros_like(p))
    served = p / seq_cumsum(p)[:, -1:]  # [R, K]
    final = order_desc(served, ids)
    return ids.gather(1, final), served.gather(1, final)


def served_distribution(logits: torch.Tensor, params: SamplingDefaults) -> torch.Tensor:
    """[R, V] fp32 served probabilities, exactly 0 outside the kept set."""
    ids, served = served_candidates(logits, params)
    return torch.zeros_like(logits).scatter_(1, ids, served)


def check_probs(probs: torch.Tensor, where: str) -> None:
    if not isinstance(probs, torch.Tensor) or probs.dtype != torch.float32:
        raise SamplingError(f"{where}: probs must be a float32 tensor")
    if probs.dim() != 2 or probs.shape[1] < 1:
        raise SamplingError(f"{where}: probs must be [R, V], got {tuple(probs.shape)}")
    if not torch.isfinite(probs).all() or (probs < 0).any():
        raise SamplingError(f"{where}: probs must be finite and >= 0")
    if probs.shape[0] and not (probs > 0).any(dim=1).all():
        raise SamplingError(f"{where}: a row of probs has no positive entry")


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """ids [R] int64: inverse CDF over the support in (prob desc, index asc) order."""
    check_probs(probs, "draw")
    R, V = probs.shape
    if not isinstance(u, torch.Tensor) or u.dtype != torch.float32 or u.shape != (R,):
        raise SamplingError(f"draw: u must be float32 [R={R}], got {getattr(u, 'shape', u)}")
    if ((u < 0) | (u >= 1)).any() or torch.isnan(u).any():
        raise SamplingError("draw: u must lie in [0, 1)")
    pos = torch.arange(V, device=probs.device).expand(R, V)  # [R, V]
    perm = order_desc(probs, pos)  # [R, V]
    vals = probs.gather(1, perm)  # [R, V], support first
    support = vals > 0  # [R, V] a prefix of each row
    c = seq_cumsum(vals)  # [R, V]; zeros after the support add exactly 0, so c[:, -1] = Z
    hit = ((u * c[:, -1])[:, None] < c) & support  # [R, V]
    last = support.sum(1) - 1  # [R]
    col = torch.where(hit.any(1), hit.to(torch.int8).argmax(1), last)  # argmax: first True
    return perm.gather(1, col[:, None])[:, 0]


def sample(
    logits: torch.Tensor,
    params: SamplingDefaults,
    seed: int,
    positions: torch.Tensor,
    purpose: Purpose = Purpose.TARGET_SAMPLE,
    index: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [R], served probs [R, V]); row r uses uniforms(seed, positions[r], purpose, index)."""
    probs = served_distribution(logits, params)
    if positions.shape != (logits.shape[0],):
        raise SamplingError(
            f"positions must be [R={logits.shape[0]}], got {tuple(positions.shape)}"
        )
    return draw(probs, uniforms(seed, positions, purpose, index)), probs
