"""Independent float64 / mpmath re-implementations of the IQuest-Q1 ops, for tests only.

Written from IQuest-Q1's published architecture, not from reference/ops.py: explicit loops over
rows, heads, experts and blocks; visibility from the window's definition (it counts the current
token: "a query at t sees t-W+1 … t"); the sink as a real extra key of value 0; E4M3 values
decoded from their bit fields.

Dimension letters: R rows, L keys, Hq/Hkv heads, D head dim, E experts, K top-k, I intermediate.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import mpmath
import torch

BLOCK = 128
F64 = torch.float64


def rms_norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.to(F64)
    ms = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return x / torch.sqrt(ms + eps) * w.to(F64)


# --- RoPE ----------------------------------------------------------------------------------


def rope_cos_sin_mp(pos: int, rotary_dim: int, theta: float, dps: int = 40):
    """[(cos, sin)] for pair i = 0 … rotary_dim/2 − 1, angle = pos · theta^(−2i/rotary_dim)."""
    with mpmath.workdps(dps):
        out = []
        for i in range(rotary_dim // 2):
            ang = mpmath.mpf(pos) * mpmath.power(mpmath.mpf(theta), -mpmath.mpf(2 * i) / rotary_dim)
            out.append((float(mpmath.cos(ang)), float(mpmath.sin(ang))))
        return out


def rope64(x: torch.Tensor, positions: list[int], rotary_dim: int, theta: float) -> torch.Tensor:
    """x [R, heads, D]; NeoX pairs (i, i + rotary_dim/2) on the first rotary_dim dims."""
    x = x.to(F64)
    out = x.clone()
    half = rotary_dim // 2
    for r, pos in enumerate(positions):
        for i, (c, s) in enumerate(rope_cos_sin_mp(int(pos), rotary_dim, theta)):
            a, b = x[r, :, i], x[r, :, i + half]
            out[r, :, i] = a * c - b * s
            out[r, :, i + half] = b * c + a * s
    return out


# --- attention -----------------------------------------------------------------------------


def sees(q_pos: int, k_pos: int, window: int | None) -> bool:
    """Causal; a window W counts the current token: t sees t−W+1 … t."""
    lo = -math.inf if window is None else q_pos - window + 1
    return lo <= k_pos <= q_pos


def attention_probs64(
    q: torch.Tensor,  # [R, Hq, D]
    k: torch.Tensor,  # [L, Hkv, D]
    q_pos: list[int],
    k_pos: list[int],
    window: int | None,
    sink_k: torch.Tensor | None,  # [Hkv, D]
    scale: float,
    group_of: Callable[[int, int, int], int] | None = None,
) -> torch.Tensor:
    """Softmax weights [R, Hq, L + 1] in float64; column L is the sink (0 without a sink).
    Invisible keys get weight exactly 0. group_of(h, Hq, Hkv) defaults to h // (Hq / Hkv)."""
    q, k = q.to(F64), k.to(F64)
    r_n, hq, _ = q.shape
    l_n, hkv, _ = k.shape
    group_of = group_of or (lambda h, nq, nkv: h // (nq // nkv))
    gidx = torch.tensor([group_of(h, hq, hkv) for h in range(hq)])  # [Hq] KV group per head
    probs = torch.zeros(r_n, hq, l_n + 1, dtype=F64)
    for r in range(r_n):
        vis = [j for j in range(l_n) if sees(int(q_pos[r]), int(k_pos[j]), window)]
        kv = k[vis][:, gidx]  # [n_vis, Hq, D]
        logits = scale * (kv * q[r][None]).sum(-1)  # [n_vis, Hq]
        if sink_k is not None:
            s = scale * (sink_k.to(F64)[gidx] * q[r]).sum(-1)  # [Hq]
            logits = torch.cat([logits, s[None]])
        ex = torch.exp(logits - logits.max(0).values)
        p = ex / ex.sum(0)
        probs[r, :, vis] = p[: len(vis)].t()
        if sink_k is not None:
            probs[r, :, l_n] = p[-1]
    return probs


def attention64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,  # [L, Hkv, D]
    q_pos: list[int],
    k_pos: list[int],
    window: int | None,
    sink_k: torch.Tensor | None,
    scale: float,
    group_of: Callable[[int, int, int], int] | None = None,
) -> torch.Tensor:
    """[R, Hq, D]: the sink is one more always-visible key whose value is the zero vector."""
    probs = attention_probs64(q, k, q_pos, k_pos, window, sink_k, scale, group_of)
    r_n, hq, _ = q.shape
    hkv = k.shape[1]
    group_of = group_of or (lambda h, nq, nkv: h // (nq // nkv))
    v_ext = torch.cat([v.to(F64), torch.zeros(1, *v.shape[1:], dtype=F64)])  # [L + 1, Hkv, D]
    out = torch.zeros(r_n, hq, v.shape[-1], dtype=F64)
    for h in range(hq):
        out[:, h] = probs[:, h] @ v_ext[:, group_of(h, hq, hkv)]
    return out


# --- router and experts --------------------------------------------------------------------


def route64(x: torch.Tensor, router_w: torch.Tensor, top_k: int):
    """(weights [R, K] float64, ids [R, K] int64): softmax, top-k by (prob desc, index asc),
    renormalized."""
    logits = x.to(F64) @ router_w.to(F64).t()  # [R, E]
    ws, ids = [], []
    for row in logits.tolist():
        m = max(row)
        ex = [math.exp(z - m) for z in row]
        tot = math.fsum(ex)
        p = [e / tot for e in ex]
        chosen = sorted(range(len(p)), key=lambda e: (-p[e], e))[:top_k]
        s = math.fsum(p[e] for e in chosen)
        ws.append([p[e] / s for e in chosen])
        ids.append(chosen)
    return torch.tensor(ws, dtype=F64), torch.tensor(ids, dtype=torch.int64)


def silu64(z: torch.Tensor) -> torch.Tensor:
    return z / (1.0 + torch.exp(-z))


def swiglu64(x, gate_w, up_w, down_w) -> torch.Tensor:
    x = x.to(F64)
    act = silu64(x @ gate_w.to(F64).t()) * (x @ up_w.to(F64).t())
    return act @ down_w.to(F64).t()


def moe64(x, weights, ids, fc, proj) -> torch.Tensor:
    """Row by row, slot by slot: Σ_k w[r,k] · expert_{ids[r,k]}(x_r); fc rows [0, I) gate."""
    inter = fc.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=F64)
    for r in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[r, j])
            y = swiglu64(x[r : r + 1], fc[e, :inter], fc[e, inter:], proj[e])[0]
            out[r] += float(weights[r, j]) * y
    return out


# --- E4M3 and block scales -----------------------------------------------------------------


def e4m3_value(code: int) -> float:
    """Decode one E4M3 (fn) byte: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111
    is NaN, there are no infinities."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * (m / 8.0) * 2.0**-6
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


def e4m3_decode(t: torch.Tensor) -> torch.Tensor:
    """Float8 tensor → float64 through the bit fields (independent of torch's cast)."""
    table = torch.tensor([e4m3_value(c) for c in range(256)], dtype=F64)
    return table[t.view(torch.uint8).long()]


def e4m3_grid() -> torch.Tensor:
    """All finite non-negative E4M3 values, ascending [127]: 0 … 448."""
    return torch.tensor(sorted({e4m3_value(c) for c in range(0x7F)}), dtype=F64)


def nearest_e4m3(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(nearest grid value with sign, is_near_tie) for float64 v already clamped to ±448.
    Exact ties go to the even code; is_near_tie flags |v| within 1e-6 relative of a midpoint
    (where a single FP32 rounding before the cast may legitimately pick either side)."""
    grid = e4m3_grid()
    a = v.abs().to(F64)
    hi = torch.searchsorted(grid, a).clamp(max=grid.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick = torch.where(d_lo < d_hi, lo, hi)
    tie = d_lo == d_hi
    pick = torch.where(tie & (lo % 2 == 0), lo, pick)  # grid index parity == code parity
    mid = (grid[lo] + grid[hi]) / 2
    near = (a - mid).abs() <= 1e-6 * mid.clamp(min=2.0**-9)
    return torch.sign(v) * grid[pick], near & (lo != hi)


def ceil_div(n: int, b: int = BLOCK) -> int:
    return -(-n // b)


def dequant_block64(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """[..., N, K] E4M3 · [..., ⌈N/128⌉, ⌈K/128⌉] scales, block by block, in float64."""
    vals = e4m3_decode(w)
    out = torch.empty_like(vals)
    n, k = w.shape[-2:]
    for bi in range(ceil_div(n)):
        for bj in range(ceil_div(k)):
            rs = slice(bi * BLOCK, min(n, (bi + 1) * BLOCK))
            cs = slice(bj * BLOCK, min(k, (bj + 1) * BLOCK))
            s = scale_inv[..., bi, bj].to(F64)[..., None, None]
            out[..., rs, cs] = vals[..., rs, cs] * s
    return out


def block_amax64(w: torch.Tensor, rows_per_block: int = BLOCK) -> torch.Tensor:
    """Per-block max |w| over valid elements only: [..., ⌈N/rows⌉, ⌈K/128⌉] float64."""
    w = w.to(F64).abs()
    n, k = w.shape[-2:]
    out = torch.empty(*w.shape[:-2], ceil_div(n, rows_per_block), ceil_div(k), dtype=F64)
    for bi in range(ceil_div(n, rows_per_block)):
        for bj in range(ceil_div(k)):
            rs = slice(bi * rows_per_block, (bi + 1) * rows_per_block)
            blk = w[..., rs, bj * BLOCK : (bj + 1) * BLOCK]
            out[..., bi, bj] = blk.amax(dim=(-2, -1))
    return out


def random_e4m3_codes(shape, gen: torch.Generator, max_code: int = 0x7E) -> torch.Tensor:
    """Random finite E4M3 values (magnitude codes 0 … max_code, random sign) as float8."""
    mag = torch.randint(0, max_code + 1, shape, generator=gen, dtype=torch.int64)
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int64) * 0x80
    return (mag | sign).to(torch.uint8).view(torch.float8_e4m3fn)


@contextlib.contextmanager
def torch_threads(n: int):
    """Run with n intra-op threads, restoring the previous count. The model tests use 1: tiny
    GEMMs gain nothing from threads, and spinning OpenMP workers on a loaded 2-core machine
    make each decode step ~20x slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
