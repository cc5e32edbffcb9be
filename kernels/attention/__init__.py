"""Decode / verification attention over a full cache or a ring, split-KV plus combine
(kernel family 3). Twin: reference.twins.attention.attention_ref.

Work decomposition. One split program per (split s, KV head g) packs the R query rows × the
G = Hq/Hkv query heads of g into the matrix rows m = r·G + j (8 × 6 = 48 rows per rank), so
each K/V tile is loaded once for all of them. The key range of a call is
[min over live rows of lo_r, max over live rows of pos_r], lo_r = max(start, pos_r − W + 1)
(sliding) or start (full), cut into tiles of BLOCK_N positions aligned to multiples of BLOCK_N
(for a ring with C % BLOCK_N == 0 each tile is contiguous in memory). The tiles are dealt to
`num_splits` programs in contiguous runs of max(min_tiles_per_split, ⌈tiles / num_splits⌉);
the grid is static (CUDA graphs), programs past the end write lse = −inf and stop. Inside a
tile every row masks its own window and causal boundary, so capacity beyond the largest live
position is never read and padding rows (r ≥ n_live) influence nothing.

Precision. QK: bf16 × bf16 → FP32 (exact products). Softmax in FP32 with exp2. PV: the FP32
probabilities are split into two bf16 terms p_hi + p_lo (relative residual ≤ 2^-16) and both
multiplied with the bf16 V in FP32, so the result matches FP32 math up to accumulation order
instead of carrying bf16-rounded probabilities. Each split stores FP32 O (normalised) and
natural-log LSE per (row, head); the combine (kernels/attention/combine.py) merges them in FP32,
applies the sink and rounds once. Padding rows are neither read for results nor written.

Interpreter branches (constexpr INTERPRET, chosen from TRITON_INTERPRET; compiled kernels never
see them): Triton 3.6's interpreter with NumPy 2.4 cannot use tensors as `range` bounds (a
`while` loop replaces the `for`), multiplies the raw bit patterns of bf16 in `tl.dot` (operands
go to FP32, exact for bf16 values) and truncates FP32 → bf16 casts (rounding to nearest even is
done by bit arithmetic). tests/kernels/test_attention.py compiles the other branches for sm_90.

Dimension letters: R rows (kernel width), Hq/Hkv heads, G = Hq/Hkv, D head dim, S splits,
M = R·G packed matrix rows, N keys per tile, C cache slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention.combine import attention_combine, combine_quantizes
from kernels.attention.common import (
    LN2,
    LOG2E,
    Partials,
    interpreting,
    n_live_tensor,
    rne_bf16,
)
from kernels.launch import launch_opts, pdl_enter
from kernels.twin import twin
from reference.kv_layout import LayerKV
from reference.twins import attention as _twins

__all__ = ["AttentionConfig", "Partials", "attention", "attention_combine", "attention_split",
           "combine_quantizes", "pick_config"]


@dataclass(frozen=True)
class AttentionConfig:
    block_n: int  # keys per tile (power of two, ≥ 16)
    num_splits: int  # split programs per KV head; static grid
    min_tiles_per_split: int  # no split gets fewer tiles while work remains
    num_warps: int
    num_stages: int
    combine_heads: int  # query heads per combine program (power of two)
    combine_splits: int  # splits one combine loop trip loads and sums (power of two)
    combine_warps: int

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"AttentionConfig.block_n: power of two >= 16, got {self.block_n}")
        if min(self.num_splits, self.min_tiles_per_split) < 1:
            raise ValueError("AttentionConfig: num_splits, min_tiles_per_split must be >= 1")
        for name in ("num_warps", "combine_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"AttentionConfig.{name}: power of two >= 1, got {v}")
        if self.num_stages < 1:
            raise ValueError(f"AttentionConfig.num_stages: must be >= 1, got {self.num_stages}")
        if self.combine_splits < 1 or self.combine_splits & (self.combine_splits - 1):
            raise ValueError(f"AttentionConfig.combine_splits: power of two >= 1, got "
                             f"{self.combine_splits}")
        if self.combine_heads < 1 or self.combine_heads & (self.combine_heads - 1):
            raise ValueError(
                f"AttentionConfig.combine_heads: power of two >= 1, got {self.combine_heads}"
            )


def pick_config(head_dim: int, capacity: int, ring: bool) -> AttentionConfig:
    """Pinned launch configs per shape (no autotuning: results must not depend on timing).

    Independent of the row count R, so a padded-width call equals the exact-width call bit for
    bit. Small head dims (the tiny preset, interpreter tests) use small tiles so that tests
    exercise many splits.
    """
    if head_dim <= 64:
        return AttentionConfig(block_n=16, num_splits=8, min_tiles_per_split=1, num_warps=4,
                               num_stages=1, combine_heads=16, combine_splits=2, combine_warps=4)
    # Chosen on the H200 by benchmarks/sweep_attention.py (reports/benchmarks/h200-2026-11-29/
    # sweep_attention*.log), 6 rows: 64-key tiles, 3 stages, 4 warps. The combine: 4-warp
    # programs per (row, head) loading up to 128 splits per trip
    # (reports/benchmarks/h200-2026-12-01/session10/): 5.2 µs at 128K vs 11.7 µs for 1-warp
    # programs adding 16 splits per trip, 3.8 vs 6.9 µs per launch in the round at 192K.
    if ring:  # 4096 + 64 slots: 66 splits of ≥ 2 tiles (12.7 µs; 32 splits, 2 stages: 15.1)
        return AttentionConfig(block_n=64, num_splits=66, min_tiles_per_split=2, num_warps=4,
                               num_stages=3, combine_heads=1, combine_splits=128, combine_warps=4)
    # full layers: ≤ 132 splits (one per SM) of ≥ 2 tiles: 64K 21.8 µs, 128K 33.8 µs with this
    # combine (264 splits: 33.1 µs at 128K but 23.0 µs at 64K; 2 stages: slower)
    return AttentionConfig(block_n=64, num_splits=min(132, triton.cdiv(capacity, 64)),
                           min_tiles_per_split=2, num_warps=4, num_stages=3, combine_heads=1,
                           combine_splits=128, combine_warps=4)


@triton.jit
def _tile(
    q, k_ptr, v_ptr, t, g, lo, pos, live, lo_all, hi_all, C, qk_scale2,
    s_kc, s_kh, s_vc, s_vh, m_i, l_i, acc,
    D: tl.constexpr, BLOCK_N: tl.constexpr, RING: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One key tile of the online softmax: positions t·N … t·N+N−1 against all M rows."""
    d = tl.arange(0, D)
    p = t * BLOCK_N + tl.arange(0, BLOCK_N)  # key positions [N]
    in_range = (p >= lo_all) & (p <= hi_all)
    if RING:
        slot = (p % C).to(tl.int64)
    else:
        in_range = in_range & (p < C)
        slot = p.to(tl.int64)
    k = tl.load(k_ptr + slot[:, None] * s_kc + g * s_kh + d[None, :],
                mask=in_range[:, None], other=0.0)  # [N, D]
    if INTERPRET:  # the interpreter's tl.dot multiplies bf16 bit patterns; FP32 is exact here
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * qk_scale2  # [M, N] log2 units
    ok = (p[None, :] >= lo[:, None]) & (p[None, :] <= pos[:, None]) & live[:, None]
    s = tl.where(ok & in_range[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: no NaN
    alpha = tl.exp2(m_i - m_safe)
    pr = tl.exp2(s - m_safe[:, None])  # [M, N] FP32
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    v = tl.load(v_ptr + slot[:, None] * s_vc + g * s_vh + d[None, :],
                mask=in_range[:, None], other=0.0)  # [N, D]
    if INTERPRET:
        v = v.to(tl.float32)
        p_hi = rne_bf16(pr)
        p_lo = rne_bf16(pr - p_hi)
    else:
        p_hi = pr.to(v.dtype)
        p_lo = (pr - p_hi.to(tl.float32)).to(v.dtype)  # p = p_hi + p_lo to 2^-16 relative
    acc = acc * alpha[:, None]
    acc = tl.dot(p_hi, v, acc)
    acc = tl.dot(p_lo, v, acc)
    return m_new, l_i, acc


@triton.jit
def _split_kernel(
    q_ptr, pos_ptr, n_live_ptr,  # q [R, Hq, D]; q_pos [R] int32; n_live [1] int32
    k_ptr, v_ptr,  # cache K, V [C, Hkv, D]
    po_ptr, pl_ptr,  # partial O [S, R, Hq, D] FP32; partial LSE [S, R, Hq] FP32
    R, C, START, WINDOW, qk_scale2,  # qk_scale2 = scale · log2(e)
    s_qr, s_qh, s_kc, s_kh, s_vc, s_vh,
    s_os, s_or, s_oh, s_ls, s_lr,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr,
    RING: tl.constexpr, SLIDING: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    split = tl.program_id(0)
    g = tl.program_id(1)
    n_live = tl.load(n_live_ptr)
    m = tl.arange(0, BLOCK_M)
    row = m // G
    head = g * G + m % G
    live = (row < n_live) & (row < R)
    pos = tl.load(pos_ptr + row, mask=live, other=0)
    if SLIDING:
        lo = tl.maximum(pos - WINDOW + 1, START)
    else:
        lo = tl.zeros_like(pos) + START
    lo_all = tl.min(tl.where(live, lo, 2147483647), axis=0)
    hi_all = tl.max(tl.where(live, pos, -1), axis=0)
    t_first = lo_all // BLOCK_N
    n_tiles = tl.maximum(hi_all // BLOCK_N - t_first + 1, 0)
    per = tl.maximum(tl.cdiv(n_tiles, NUM_SPLITS), MIN_TILES)
    t_begin = t_first + split * per
    t_end = tl.minimum(t_begin + per, t_first + n_tiles)

    d = tl.arange(0, D)
    q = tl.load(q_ptr + row[:, None] * s_qr + head[:, None] * s_qh + d[None, :],
                mask=live[:, None], other=0.0)  # [M, D] bf16
    if INTERPRET:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if INTERPRET:  # the interpreter (NumPy ≥ 2.4) cannot take tensor `range` bounds
        t = t_begin
        while t < t_end:
            m_i, l_i, acc = _tile(q, k_ptr, v_ptr, t, g, lo, pos, live, lo_all, hi_all, C,
                                  qk_scale2, s_kc, s_kh, s_vc, s_vh, m_i, l_i, acc,
                                  D, BLOCK_N, RING, INTERPRET)
            t += 1
    else:
        for t in range(t_begin, t_end):
            m_i, l_i, acc = _tile(q, k_ptr, v_ptr, t, g, lo, pos, live, lo_all, hi_all, C,
                                  qk_scale2, s_kc, s_kh, s_vc, s_vh, m_i, l_i, acc,
                                  D, BLOCK_N, RING, INTERPRET)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2,
                   float("-inf"))
    tl.store(pl_ptr + split * s_ls + row * s_lr + head, lse, mask=live)
    tl.store(po_ptr + split * s_os + row[:, None] * s_or + head[:, None] * s_oh + d[None, :],
             o, mask=(live & (tl.where(has, 1, 0) == 1))[:, None])


def _check_inputs(q, cache: LayerKV, q_pos, sink_k, where: str):
    lay = cache.layout
    if q.dim() != 3 or q.shape[2] != lay.head_dim or q.shape[1] % lay.kv_heads:
        raise ValueError(
            f"{where}: q must be [R, Hq, {lay.head_dim}] with Hq a multiple of "
            f"Hkv={lay.kv_heads}, got {tuple(q.shape)}"
        )
    r, dev = q.shape[0], cache.k.device
    if not 1 <= r <= 64:
        raise ValueError(f"{where}: q rows R must be in [1, 64], got {r}")
    if q.dtype != cache.k.dtype or q.stride(-1) != 1 or q.device != dev:
        raise ValueError(
            f"{where}: q must be {cache.k.dtype} on {dev} with a contiguous last dim, got "
            f"{q.dtype} on {q.device} strides {q.stride()}"
        )
    if lay.head_dim & (lay.head_dim - 1) or lay.head_dim < 16:
        raise ValueError(f"{where}: head_dim must be a power of two >= 16, got {lay.head_dim}")
    for name, t in (("cache.k", cache.k), ("cache.v", cache.v)):
        want = (lay.capacity, lay.kv_heads, lay.head_dim)
        if tuple(t.shape) != want or t.stride(-1) != 1:
            raise ValueError(f"{where}: {name} must be {want}, last dim contiguous; got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    if q_pos.dtype != torch.int32 or tuple(q_pos.shape) != (r,) or q_pos.device != dev:
        raise ValueError(f"{where}: q_pos must be int32 [{r}] on {dev}, got {q_pos.dtype} "
                         f"{tuple(q_pos.shape)} on {q_pos.device}")
    if lay.ring and lay.capacity < lay.window + r - 1:
        raise ValueError(
            f"{where}: ring of {lay.capacity} slots cannot serve {r} rows written before reading "
            f"with window {lay.window}; needs >= window + R − 1 = {lay.window + r - 1} "
            f"(see kernels/kv_cache.py)"
        )
    if sink_k is not None and (
        tuple(sink_k.shape) != (lay.kv_heads, lay.head_dim) or sink_k.stride(-1) != 1
        or sink_k.device != dev
    ):
        raise ValueError(f"{where}: sink_k must be [{lay.kv_heads}, {lay.head_dim}] on {dev}, "
                         f"last dim contiguous; got {tuple(sink_k.shape)} on {sink_k.device}")


def attention_split(
    q: torch.Tensor,  # [R, Hq, D] bf16, q-normed and roped
    cache: LayerKV,
    q_pos: torch.Tensor,  # [R] int32 device
    n_live,  # 1-element int32 device tensor or int
    scale: float,
    *,
    config: AttentionConfig | None = None,
    pdl: bool = False,  # programmatic dependent launch (kernels/launch.py)
) -> Partials:
    _check_inputs(q, cache, q_pos, None, "attention_split")
    return _launch_split(q, cache, q_pos, n_live_tensor(n_live, q.device), scale,
                         config or pick_config(cache.layout.head_dim, cache.layout.capacity,
                                               cache.layout.ring), pdl=pdl)


def _launch_split(q, cache: LayerKV, q_pos, n_live_t, scale, cfg: AttentionConfig, *,
                  pdl: bool = False) -> Partials:
    lay = cache.layout
    r, hq, d = q.shape
    g = hq // lay.kv_heads
    s = cfg.num_splits
    po = torch.empty((s, r, hq, d), dtype=torch.float32, device=q.device)
    pl = torch.empty((s, r, hq), dtype=torch.float32, device=q.device)
    _split_kernel[(s, lay.kv_heads)](
        q, q_pos, n_live_t, cache.k, cache.v, po, pl,
        r, lay.capacity, lay.start, lay.window or 0, scale * LOG2E.value,
        q.stride(0), q.stride(1), cache.k.stride(0), cache.k.stride(1),
        cache.v.stride(0), cache.v.stride(1),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        G=g, D=d, BLOCK_M=max(16, triton.next_power_of_2(r * g)), BLOCK_N=cfg.block_n,
        NUM_SPLITS=s, MIN_TILES=cfg.min_tiles_per_split,
        RING=lay.ring, SLIDING=lay.window is not None, INTERPRET=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_opts(pdl),
    )
    return Partials(po, pl)


@twin(_twins.attention_ref)
def attention(
    q: torch.Tensor,  # [R, Hq, D] bf16, q-normed and roped; rows >= n_live are padding
    cache: LayerKV,
    q_pos: torch.Tensor,  # [R] int32 device; each live row's KV is already written
    n_live,  # 1-element int32 device tensor (no host sync) or int
    sink_k: torch.Tensor | None,  # [Hkv, D], not rotated, zero value
    scale: float,
    out: torch.Tensor | None = None,  # [R, Hq, D]; padding rows are left untouched
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: AttentionConfig | None = None,
    quant_out: tuple[torch.Tensor, torch.Tensor] | None = None,  # see attention_combine
    pdl: bool = False,  # programmatic dependent launch (kernels/launch.py), both launches
) -> torch.Tensor:
    _check_inputs(q, cache, q_pos, sink_k, "attention")
    lay = cache.layout
    cfg = config or pick_config(lay.head_dim, lay.capacity, lay.ring)
    if out is None:
        out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    n = n_live_tensor(n_live, q.device)
    parts = _launch_split(q, cache, q_pos, n, scale, cfg, pdl=pdl)
    return attention_combine(parts, q, sink_k, n, scale, out,
                             heads_per_program=cfg.combine_heads,
                             splits_per_trip=cfg.combine_splits, combine_warps=cfg.combine_warps,
                             quant_out=quant_out, pdl=pdl)
