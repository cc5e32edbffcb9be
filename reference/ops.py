"""Pure-torch oracles for every IQuest-Q1 operation. Boring on purpose: no fusion, every op
computed in FP64 and rounded once at its end — to FP32, then to the output dtype.

Why FP64: the bits of an FP32 GEMM, exp or vectorized reduction on the CPU depend on the code
path the CPU selects (MKL's sgemm kernels and VML exp under MKL_CBWR, AMX vs AVX-512 hosts, ATen's
vector width), so an FP32 oracle's bits would be a property of the machine. In FP64 every product
of FP32 (or BF16) inputs is exact and a sum's rounding error is ~2⁻⁵³ relative; rounded to FP32
the result is the correctly rounded value on any code path, except when the exact value sits
within that error of an FP32 rounding midpoint (a chance of about K·2⁻²⁹ per output of a K-term
sum, ~1e-7 at K = 64, and such a one-ulp difference must then also change a token). In FP32 every
output differed between code paths. tests/qualification/test_platform_bits.py holds the golden
digests equal under the MKL / oneDNN / ATen settings that change FP32 results.

Dimension letters: R rows (tokens), L keys in range, H hidden, Hq query heads, Hkv KV heads,
D head dim, E experts, K top-k, I expert intermediate, V vocabulary.
"""

from __future__ import annotations

import torch

from reference.params import FP8_BLOCK

E4M3_MAX = 448.0


def round_to(y: torch.Tensor, dtype) -> torch.Tensor:
    """An FP64 result rounded to FP32, then to dtype (a BF16 output is rounded from FP32, as a
    kernel's FP32 accumulator is)."""
    return y.float().to(dtype)


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b[..., N, K]ᵀ in FP64 → FP64 [..., M, N]: exact products, a sum whose
    bits survive rounding to FP32 on every BLAS code path (module docstring)."""
    return a.double() @ b.double().transpose(-1, -2)


def exp32(x: torch.Tensor) -> torch.Tensor:
    """exp of FP32 x in FP64, rounded to FP32: the correctly rounded FP32 exp except at a
    rounding midpoint, where torch's FP32 exp differs between MKL VML code paths."""
    return torch.exp(x.double()).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype=None) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) · weight over the last dim (plain weight, not 1 + w), in FP64,
    then round_to (FP32, then the output dtype): where the FP64 value lies within an FP32
    rounding of a bf16 midpoint this can differ by one bf16 step from a kernel that rounds its
    FP32 inverse norm and products (the norms' flip rows in qualification/tolerances.py)."""
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return round_to(y, out_dtype or x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """x [R, in] @ weight[out, in]ᵀ (gemm), rounded once to out_dtype."""
    return round_to(gemm(x, weight), out_dtype or x.dtype)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float):
    """cos, sin [R, rotary_dim/2] in FP32 for NeoX rotate-half on the first rotary_dim dims."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(half, dtype=torch.float64) * 2.0 / rotary_dim))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [R, half]
    return torch.cos(ang).float(), torch.sin(ang).float()


def rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Partial NeoX RoPE. x [R, heads, D]; only dims [0, rotary_dim) rotate, pairs (i, i+half)."""
    half = rotary_dim // 2
    cos, sin = rope_cos_sin(positions, rotary_dim, theta)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [R, 1, half]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return out.to(x.dtype)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[R, L] bool: key at k_pos is visible from query at q_pos (causal; window counts self)."""
    d = q_pos[:, None] - k_pos[None, :]
    mask = d >= 0
    if window is not None:
        mask &= d < window
    return mask


def attention(
    q: torch.Tensor,  # [R, Hq, D] after q-norm and RoPE
    k: torch.Tensor,  # [L, Hkv, D] after k-norm and RoPE
    v: torch.Tensor,  # [L, Hkv, D]
    q_pos: torch.Tensor,  # [R] int
    k_pos: torch.Tensor,  # [L] int
    window: int | None,
    sink_k: torch.Tensor | None,  # [Hkv, D], not rotated; value 0
    scale: float,
    out_dtype=None,
) -> torch.Tensor:
    """GQA attention with an optional learned sink key, in FP64, rounded once. Returns
    [R, Hq, D].

    The sink enters through the log-sum-exp: O ← O · sigmoid(L − s), s = scale·⟨q_h, sink_k[g]⟩,
    g = h // (Hq / Hkv) — identical to softmax with one extra always-visible key of logit s
    and value 0.
    """
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf, kf, vf = q.double(), k.double(), v.double()
    kf = kf.repeat_interleave(group, dim=1)  # [L, Hq, D]
    vf = vf.repeat_interleave(group, dim=1)
    scores = gemm(qf.transpose(0, 1), kf.transpose(0, 1)) * scale  # [Hq, R, L]
    mask = visible(q_pos, k_pos, window)  # [R, L]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, R]
    probs = torch.exp(scores - lse[..., None])
    out = (probs @ vf.transpose(0, 1)).transpose(0, 1)  # [R, Hq, D]
    if sink_k is not None:
        sk = sink_k.double().repeat_interleave(group, dim=0)  # [Hq, D]
        s = (qf * sk[None]).sum(-1).t() * scale  # [Hq, R]
        out = out * torch.sigmoid(lse - s).t()[..., None]
    return round_to(out, out_dtype or q.dtype)


def route(
    x: torch.Tensor, router_w: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: softmax over experts → top-k (ties: lower index first) → renormalize.

    x [R, H], router_w [E, H] → weights [R, K] FP32, ids [R, K] int64, ordered by (probability
    desc, expert index asc). The probabilities are computed in FP64 and rounded to FP32 (the
    top-k order is that of the FP32 values); the renormalization is FP64, rounded once.
    """
    probs = torch.softmax(gemm(x, router_w), dim=-1).float()  # [R, E]
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    w = sorted_p[:, :top_k].double()
    return (w / w.sum(-1, keepdim=True)).float(), order[:, :top_k]


def swiglu(
    x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor
) -> torch.Tensor:
    """down(silu(gate(x)) · up(x)); each projection rounds to x.dtype, as a BF16 engine would."""
    g = linear(x, gate_w)
    u = linear(x, up_w)
    return linear(silu_mul(g, u, x.dtype), down_w)


def silu_mul(g: torch.Tensor, u: torch.Tensor, dtype) -> torch.Tensor:
    """silu(g) · u in FP64, rounded once to dtype: the activation of swiglu."""
    gd = g.double()
    return round_to(gd * torch.sigmoid(gd) * u.double(), dtype)


def moe(
    x: torch.Tensor,  # [R, H] normalized expert input
    weights: torch.Tensor,  # [R, K] FP32 router weights
    ids: torch.Tensor,  # [R, K] expert indices
    fc: torch.Tensor,  # [E, 2I, H]: rows [0, I) gate, [I, 2I) up
    proj: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:
    """Σ_k weights[r, k] · expert_{ids[r, k]}(x_r), accumulated in FP32 in k order; [R, H].

    Each expert runs one GEMM over exactly the rows routed to it (like a grouped MoE engine),
    so appending rows can change the row count of an expert GEMM.
    """
    inter = fc.shape[1] // 2
    r, k = ids.shape
    expert_out = torch.zeros(r, k, x.shape[1], dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        y = swiglu(x[rows], fc[e, :inter], fc[e, inter:], proj[e])  # [n_e, H]
        expert_out[rows, slots] = y.float()
    acc = torch.zeros(r, x.shape[1], dtype=torch.float32)
    for j in range(k):
        acc = acc + weights[:, j : j + 1] * expert_out[:, j]
    return acc.to(x.dtype)


# --- block FP8 (E4M3, 128x128 weight blocks, 1x128 activation blocks) ---------------------


def _blocks(n: int, b: int = FP8_BLOCK) -> int:
    return -(-n // b)


def expand_scales(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[..., ceil(rows/128), ceil(cols/128)] → [..., rows, cols] (each block's scale repeated)."""
    s = scale.repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    return s[..., :rows, :cols]


def dequant_block(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """E4M3 weight [..., N, K] · FP32 inverse scales [..., ceil(N/128), ceil(K/128)] → FP32."""
    *lead, rows, cols = w.shape
    want = (*lead, _blocks(rows), _blocks(cols))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"dequant_block: scale_inv shape {tuple(scale_inv.shape)} does not match weight "
            f"{tuple(w.shape)}; expected {want} (ceil-div by {FP8_BLOCK})"
        )
    return w.float() * expand_scales(scale_inv.float(), rows, cols)


def quantize_block(
    w: torch.Tensor, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., N, K] → (E4M3 [..., N, K], FP32 inverse scales [..., ⌈N/128⌉, ⌈K/128⌉]).

    scale_inv = amax / 448 per block (1 for an all-zero block), q = RNE(w / scale_inv), so the
    block's largest magnitude maps to ±448. Partial edge blocks take the amax of their valid
    elements only. power_of_two rounds each scale up to 2^ceil(log2) (lossless for data that is
    already on such a grid).
    """
    *lead, rows, cols = w.shape
    nr, nc = _blocks(rows), _blocks(cols)
    wf = w.float()
    pad = torch.zeros(*lead, nr * FP8_BLOCK, nc * FP8_BLOCK)
    pad[..., :rows, :cols] = wf.abs()
    tiles = pad.reshape(*lead, nr, FP8_BLOCK, nc, FP8_BLOCK)
    amax = tiles.amax(dim=(-3, -1))  # [..., nr, nc]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (wf / expand_scales(scale, rows, cols)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [R, K] → (E4M3 [R, K], FP32 scales [R, ⌈K/128⌉]).

    Per row and 128-column group: scale = amax / 448 (1 for an all-zero group), q = RNE(x / scale).
    """
    r, cols = x.shape
    nc = _blocks(cols)
    xf = x.float()
    pad = torch.zeros(r, nc * FP8_BLOCK)
    pad[:, :cols] = xf.abs()
    amax = pad.reshape(r, nc, FP8_BLOCK).amax(-1)  # [R, nc]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(FP8_BLOCK, dim=-1)[:, :cols]
    q = (xf / full).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def dequant_act(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    *lead, cols = q.shape
    if tuple(scale.shape) != (*lead, _blocks(cols)):
        raise ValueError(
            f"dequant_act: scale shape {tuple(scale.shape)} does not match activation "
            f"{tuple(q.shape)}; expected {(*lead, _blocks(cols))} (ceil-div by {FP8_BLOCK})"
        )
    return q.float() * scale.repeat_interleave(FP8_BLOCK, dim=-1)[..., :cols]
