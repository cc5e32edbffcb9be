"""Gate 5, the mathematics: the exact law of one speculative round on a Markov target/draft,
its identity with the target chain, and the G-test with its power.

Dimension letters: V vocabulary, D drafts per round, K outcome cells kept on their own.

Exact law. Rows are the served fp32 probabilities as rationals, normalized (p̂ = p / Σp: fp32
rows do not sum to 1 exactly). Target row P[c] and draft row Q[c] follow token c. From the
committed token x0 the round drafts d_1 … d_D (d_i ~ Q[d_{i−1}]), accepts d_i with probability
min(1, p̂/q̂)(d_i), and at the first rejection emits t ~ norm(max(0, p̂ − q̂)); after D accepts it
emits the bonus b ~ P[d_D]. The outcome is the emitted block (d_1 … d_k, t), k = 0 … D: its
length is part of the outcome. Two identities are asserted in rationals: the first emitted token
has law P[x0]; and the block, completed by plain target sampling to the horizon D + 1, has the
law of D + 1 steps of the target chain from x0 (shorter horizons are its marginals). The
implementation's own law differs from this one by fp32 rounding and the 2^-24 uniform grid only
(≤ 3e-4 relative per token, tolerance row reference.emitted_token_law), far below what N draws
can see.

Cells. Outcomes are ordered by (probability desc, code asc); the K first are cells of their own,
the rest form one pooled cell, and every cell (the pool included, when not empty) must have an
expected count ≥ 5. Among those K, the one with the least detectable TV below is used: K depends
on the exact law and N only, never on the draws. An outcome the exact law gives probability 0
fails the gate outright.

Power. A law whose total variation from the exact law is t over all outcomes has TV ≥ t − m over
the cells, m the pooled mass (only moves inside the pooled cell are invisible). Over the cells,
Σ δ²/π ≥ (Σ|δ|)² / Σπ = 4·TV² (Cauchy–Schwarz; equality when the mass moves between two halves
of probability 1/2, each cell in proportion to π): the least favourable perturbation. The G
statistic is then noncentral χ² with df = cells − 1 and λ ≥ 4N(t − m)², so
power(t) ≥ ncx2.sf(chi2.isf(α′, df), df, 4N(t − m)²) for every law at TV ≥ t, and the TV
detected with power β is m + sqrt(λ*/4N), λ* the noncentrality giving power β.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction as Fr

import numpy as np
import torch
from scipy import special, stats

Row = list[Fr]
Law = dict[tuple[int, ...], Fr]
MIN_EXPECTED = 5.0


# --- exact law ---------------------------------------------------------------------------------
def exact_rows(probs: torch.Tensor) -> list[Row]:
    """[V, V] fp32 served rows → rows of exact rationals, each normalized to sum 1."""
    rows = []
    for r in probs.double().tolist():
        fr = [Fr(v) for v in r]
        s = sum(fr)
        if s <= 0:
            raise ValueError("exact_rows: a served row has no positive probability")
        rows.append([v / s for v in fr])
    return rows


def accept_min(p: Row, q: Row, d: int) -> Fr:
    return min(Fr(1), p[d] / q[d])


def residual_exact(p: Row, q: Row) -> Row:
    r = [max(Fr(0), a - b) for a, b in zip(p, q, strict=True)]
    s = sum(r)
    return [v / s for v in r] if s else list(p)


@dataclass(frozen=True)
class Rule:
    """The verification rule; tests plant defects through these hooks."""

    accept: Callable[[Row, Row, int], Fr] = accept_min  # P(accept d) given p̂, q̂ of the step
    replacement: Callable[[Row, Row], Row] = residual_exact
    bonus_after_rejection: bool = False  # emit a token from the rejected draft's target row


STANDARD = Rule()


def block_law(P: list[Row], Q: list[Row], x0: int, D: int, rule: Rule = STANDARD) -> Law:
    """Law of the emitted block of one round from committed token x0 (D ≥ 1)."""
    V = len(P)
    acc, rej = [], []  # per context token c: [(d, q̂·a)], [(block tail, mass)]
    for c in range(V):
        p, q = P[c], Q[c]
        a = [rule.accept(p, q, d) if q[d] else Fr(0) for d in range(V)]
        acc.append([(d, q[d] * a[d]) for d in range(V) if q[d] * a[d]])
        r = rule.replacement(p, q)
        tails: dict[tuple[int, ...], Fr] = defaultdict(Fr)
        for d in range(V):
            miss = q[d] * (1 - a[d])
            for t in range(V):
                if not (miss and r[t]):
                    continue
                if rule.bonus_after_rejection:
                    for b in range(V):
                        tails[(t, b)] += miss * r[t] * P[d][b]
                else:
                    tails[(t,)] += miss * r[t]
        rej.append([(k, v) for k, v in tails.items() if v])
    law: Law = defaultdict(Fr)
    stack = [((), x0, Fr(1))]
    while stack:
        prefix, c, mass = stack.pop()
        if len(prefix) == D:
            for t, v in enumerate(P[c]):
                if v:
                    law[prefix + (t,)] += mass * v
            continue
        for tail, v in rej[c]:
            law[prefix + tail] += mass * v
        stack.extend((prefix + (d,), d, mass * v) for d, v in acc[c])
    return {k: v for k, v in law.items() if v}


def chain_law(P: list[Row], x0: int, h: int) -> Law:
    """Law of h steps of the target chain from x0."""
    law: Law = {(): Fr(1)}
    for _ in range(h):
        law = {
            s + (t,): m * v
            for s, m in law.items()
            for t, v in enumerate(P[s[-1] if s else x0])
            if v
        }
    return law


def horizon_law(block: Law, P: list[Row], h: int) -> Law:
    """The first h emitted tokens when a shorter block is continued by plain target sampling."""
    ext: dict[tuple[int, int], Law] = {}
    out: Law = defaultdict(Fr)
    for blk, m in block.items():
        if len(blk) >= h:
            out[blk[:h]] += m
            continue
        key = (blk[-1], h - len(blk))
        if key not in ext:
            ext[key] = chain_law(P, *key)
        for tail, v in ext[key].items():
            out[blk + tail] += m * v
    return {k: v for k, v in out.items() if v}


def law_identities(P: list[Row], Q: list[Row], x0: int, D: int, block: Law) -> list[str]:
    """The identities of the module docstring, in rationals; the failures, by name."""
    bad = []
    if sum(block.values()) != 1:
        bad.append("block law does not sum to 1")
    first: dict[int, Fr] = defaultdict(Fr)
    for blk, m in block.items():
        first[blk[0]] += m
    if [first.get(t, Fr(0)) for t in range(len(P))] != P[x0]:
        bad.append(f"first emitted token is not distributed as the target row of token {x0}")
    if horizon_law(block, P, D + 1) != chain_law(P, x0, D + 1):
        bad.append(f"emitted tokens completed to horizon {D + 1} differ from the target chain")
    return bad


# --- outcome codes -----------------------------------------------------------------------------
def encode(blocks: torch.Tensor, lengths: torch.Tensor, V: int) -> torch.Tensor:
    """blocks [n, W] int64 (entries past each length ignored), lengths [n] → codes [n] int64:
    Σ_i (t_i + 1)·(V + 1)^i, so blocks of different lengths never share a code."""
    W = blocks.shape[1]
    place = (V + 1) ** torch.arange(W, dtype=torch.int64)  # [W]
    live = torch.arange(W)[None, :] < lengths[:, None]  # [n, W]
    return ((blocks + 1) * place * live).sum(1)


def encode_tuple(block: tuple[int, ...], V: int) -> int:
    return sum((t + 1) * (V + 1) ** i for i, t in enumerate(block))


def decode(code: int, V: int) -> tuple[int, ...]:
    out = []
    while code:
        code, r = divmod(code, V + 1)
        out.append(r - 1)
    return tuple(out)


# --- cells, G-test, power ----------------------------------------------------------------------
@dataclass(frozen=True)
class Cells:
    codes: torch.Tensor  # [K] int64 outcomes with a cell of their own, most probable first
    probs: np.ndarray  # [C] float64 cell probabilities: the K kept, then the pool if non-empty
    support: torch.Tensor  # [S] int64 sorted codes of every outcome with probability > 0
    pooled_mass: float

    @property
    def df(self) -> int:
        return len(self.probs) - 1


def ordered(law: Law, V: int) -> tuple[torch.Tensor, np.ndarray]:
    """(codes [S], float64 probs [S]) in the order (probability desc, code asc)."""
    items = sorted(((-m, encode_tuple(k, V)) for k, m in law.items()))
    codes = torch.tensor([c for _, c in items], dtype=torch.int64)
    probs = np.array([float(-m) for m, _ in items], dtype=np.float64)
    return codes, probs / probs.sum()


class Noncentrality:
    """λ*(df): the noncentrality at which the level-α χ² test with df degrees of freedom has the
    given power; computed by bisection on scipy's ncx2 for df = 1 … as many as asked."""

    def __init__(self, alpha: float, power: float):
        self.alpha, self.power = alpha, power
        self.table = np.zeros(0)  # [df] λ* for df = 1 … len

    def __call__(self, df: np.ndarray) -> np.ndarray:
        top = int(np.max(df, initial=0))
        if top > len(self.table):
            d = np.arange(1, top + 1)
            crit = stats.chi2.isf(self.alpha, d)
            lo, hi = np.zeros(top), 4 * crit + 100  # ncx2.sf(crit, d, hi) ≈ 1
            for _ in range(60):
                mid = (lo + hi) / 2
                ok = stats.ncx2.sf(crit, d, mid) >= self.power
                lo, hi = np.where(ok, lo, mid), np.where(ok, mid, hi)
            self.table = hi
        return self.table[np.asarray(df) - 1]


def cell_options(probs: np.ndarray, n: int, lam: Noncentrality):
    """Every admissible K (all cells expected ≥ 5): (K, pooled mass, detectable TV), where the
    detectable TV = pooled + sqrt(λ*(df) / 4N) is the least TV over all outcomes that the test
    detects with the wanted power (module docstring)."""
    tail = np.concatenate([np.cumsum(probs[::-1])[::-1][1:], [0.0]])  # pooled mass after K
    ks = np.arange(1, int(np.sum(probs * n >= MIN_EXPECTED)) + 1)
    pooled = tail[ks - 1]
    keep = ((pooled == 0) | (pooled * n >= MIN_EXPECTED)) & (ks - (pooled == 0) >= 1)
    ks, pooled = ks[keep], pooled[keep]
    df = ks - (pooled == 0)  # cells − 1
    return ks, pooled, pooled + np.sqrt(lam(df) / (4 * n))


def make_cells(codes: torch.Tensor, probs: np.ndarray, n: int, lam: Noncentrality) -> Cells:
    """The K with the least detectable TV at this N (the fewest cells among equals)."""
    ks, pooled, tv = cell_options(probs, n, lam)
    if len(ks) == 0:
        raise ValueError(f"make_cells: N={n} is too small for two cells with expected count >= 5")
    i = int(np.argmin(tv))
    k = int(ks[i])
    cell_p = np.concatenate([probs[:k], [pooled[i]] if pooled[i] > 0 else []])
    return Cells(codes[:k].clone(), cell_p, codes.sort().values, float(pooled[i]))


def detectable_tv(cells: Cells, n: int, lam: Noncentrality) -> float:
    return float(cells.pooled_mass + np.sqrt(lam(np.array([cells.df]))[0] / (4 * n)))


def power_at(cells: Cells, n: int, tv: float, alpha: float) -> float:
    """Least-favourable power against every law at TV ≥ tv over all outcomes."""
    eff = tv - cells.pooled_mass
    if eff <= 0:
        return 0.0
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, cells.df), cells.df, 4 * n * eff**2))


def choose_n(
    codes: torch.Tensor, probs: np.ndarray, tv: float, lam: Noncentrality, step: int = 1000,
    n_max: int = 20_000_000,
) -> tuple[int, Cells]:
    """The least N (a multiple of `step`: a 5% geometric ladder, then `step` increments from the
    last rung that failed) whose best cells detect TV `tv`."""

    def ok(n: int) -> bool:
        return float(np.min(cell_options(probs, n, lam)[2], initial=np.inf)) <= tv

    lo, hi = 0, step
    while not ok(hi):
        if hi > n_max:
            raise ValueError(f"choose_n: detecting TV {tv} needs N > {n_max}")
        lo, hi = hi, max(hi + step, -(-int(hi * 1.05) // step) * step)
    n = lo + step
    while not ok(n):
        n += step
    return n, make_cells(codes, probs, n, lam)


@dataclass(frozen=True)
class GTest:
    g: float
    df: int
    p_value: float
    impossible: int  # draws of outcomes the exact law gives probability 0
    worst: int  # code of the cell with the largest |observed − expected| / sqrt(expected), −1 pool
    worst_z: float


def g_test(draws: torch.Tensor, cells: Cells) -> GTest:
    """G = 2 Σ O ln(O / E) over the cells; outcomes outside the support give p = 0."""
    n = draws.numel()
    uniq, cnt = torch.unique(draws, return_counts=True)
    pos = torch.searchsorted(cells.support, uniq).clamp(max=max(len(cells.support) - 1, 0))
    inside = cells.support[pos] == uniq
    impossible = int(cnt[~inside].sum())
    obs = np.zeros(len(cells.probs))
    kept = {int(c): i for i, c in enumerate(cells.codes.tolist())}
    pool = len(cells.codes)
    for c, k in zip(uniq[inside].tolist(), cnt[inside].tolist(), strict=True):
        obs[kept.get(c, pool)] += k
    exp = n * cells.probs
    # an impossible draw is a cell with expected count 0: G = inf
    g = float(2 * np.sum(special.xlogy(obs, obs / exp))) if not impossible else float("inf")
    z = (obs - exp) / np.sqrt(exp)
    w = int(np.argmax(np.abs(z)))
    worst = int(cells.codes[w]) if w < pool else -1
    p = 0.0 if impossible else float(stats.chi2.sf(g, cells.df))
    return GTest(g, cells.df, p, impossible, worst, float(z[w]))
