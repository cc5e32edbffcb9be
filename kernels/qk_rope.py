"""Attention prologue on the QKV projection: per-head RMSNorm of q and k, partial NeoX RoPE, split
into q / k / v heads; with the layer's cache, the KV write of those rows in the same launch
(the runtime's path: one launch instead of two per layer). Twin: reference/twins/qk_rope.py
`qk_rope_ref`.

Dimension letters: R rows in the buffer, n live rows (device int32 [1]), S split-K partials,
Hq / Hkv query / KV heads, D head dim, W = (Hq + 2·Hkv)·D, P table positions, rot rotary dims.

Rounding points are those of reference/model.py `_attn` in BF16 mode: qkv rounded to bf16 after
the projection (here: FP32 split-K partials summed s = 0, 1, …, S−1 then rounded, the bits that
kernels.linear.linear_fp8 with out_dtype=bf16 returns, so the QKV GEMM needs no reduce kernel),
q and k rounded after the norm and again after RoPE; v is the rounded projection.

Where the kernel departs from the FP32 reference on purpose (the twin copies it):
  * the sum of squares of a head is accumulated in FP64 and rounded once to FP32. bf16 squares
    are exact, so the FP64 sum is order-free except for bits ~2^-46 below the total: a parallel
    reduction and torch give the same FP32 value, where an FP32 sum would depend on reduction
    order (and torch's CPU order on the vector ISA). The rest of the norm is IEEE FP32 in the
    reference's order: mean = ss / D, r = 1 / sqrt(mean + eps) (both correctly rounded; torch's
    CPU rsqrt is exactly this), y = (x · r) · w.
  * cos / sin are gathered from a table built by reference.ops.rope_cos_sin (angles in FP64,
    rounded to FP32), so RoPE is the reference's own arithmetic: x1·cos − x2·sin and
    x2·cos + x1·sin, each product rounded: the products are explicit PTX mul.rn, which no FMA
    contraction touches (the standalone launch also runs with enable_fp_fusion=False; the folded
    QKV launch cannot, its GEMM's bits are those of the contracted linear kernel).
Table memory: P × rot × 4 bytes; 524288 positions × 32 dims = 64 MB per RoPE base (two bases in
IQuest-Q1). Positions outside [0, P) give NaN q and k rows (no host check: n is on the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arrival import last_arrival
from kernels.attention.common import interpreting
from kernels.checks import check_quantized, check_tensor, live_count
from kernels.fp8 import bf16_rne, quantize_act
from kernels.kv_cache import check_cache
from kernels.launch import launch_opts, pdl_enter
from kernels.linear import (
    BLOCK_R,
    _check_fp8_args,
    _partials_buffer,
    check_prefetch,
    fp8_program,
    prefetch_weights,
)
from kernels.linear_launch import LinearLaunch
from kernels.twin import twin
from reference import ops
from reference.kv_layout import LayerKV
from reference.twins import qk_rope as _twins


@dataclass(frozen=True)
class RopeTable:
    cos_sin: torch.Tensor  # [P, rot] fp32: [:, :rot/2] cos, [:, rot/2:] sin of angle p + offset
    rotary_dim: int
    theta: float
    offset: int = 0  # row p rotates by position p + offset (the draft's position convention)

    @property
    def positions(self) -> int:
        return self.cos_sin.shape[0]


def rope_table(max_positions: int, rotary_dim: int, theta: float, device,
               offset: int = 0) -> RopeTable:
    """Row p: cos / sin of position p + offset for every p < max_positions, exactly
    reference.ops.rope_cos_sin's values."""
    if max_positions < 1:
        raise ValueError(f"rope_table: max_positions must be >= 1, got {max_positions}")
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rope_table: rotary_dim must be even and >= 2, got {rotary_dim}")
    cos, sin = ops.rope_cos_sin(torch.arange(max_positions) + offset, rotary_dim, theta)
    return RopeTable(torch.cat([cos, sin], dim=1).to(device), rotary_dim, float(theta), offset)


@dataclass(frozen=True)
class QkvLaunch:
    """How the runtime's attention prologue launches (iquestrt/ops_kernels.py qkv_rope)."""

    fold_rope: bool = False  # the QKV projection and qk_rope in one launch (qkv_rope below)


def qkv_launch() -> QkvLaunch:
    """Pinned: the two launches (linear_fp8_partials, then qk_rope). The fold is slower on the
    H200 at 98c5cff (reports/benchmarks/h200-2026-12-06c/call2/): rounds 1.9–2.1 % longer at
    1K widths 6 and 8 (`benchmarks.rank --launch qkv.fold_rope=1`, alternating), and per layer
    8.20 / 8.54 µs vs 6.80 / 6.83 µs at 1 / 6 rows (`benchmarks.bench_qkv_rope`, 87 layers per
    graph). The launch it saves (≈ 1 µs in a graph) costs less than what the fold puts on the
    critical path: every program's acq_rel arrival, then one program per head doing the whole
    qk_rope of its head after the slowest tile of the group — the serial tail the MoE's folded
    SiLU showed too (kernels/moe_launch.py). Worth revisiting if the finish can start before
    the last tile (rows split across several finishers, or the finish overlapped with the
    next launch through PDL)."""
    return QkvLaunch()


@dataclass(frozen=True)
class QkRopeLaunch:
    num_warps: int = 1  # one program per (row block, head): D ≤ 256 values a row
    # Rows per program, a power of two. None: 1 compiled; under the interpreter every row in one
    # block: the interpreter runs each program as Python (10–15 ms at the tiny model's head
    # size), and a program per row makes qk_rope half of an interpreted forward. A row's values
    # never depend on its block-mates (qk_rope_rows): every choice gives the same bits.
    rows: int | None = None

    def __post_init__(self) -> None:
        if self.rows is not None and (self.rows < 1 or self.rows & (self.rows - 1)):
            raise ValueError(f"QkRopeLaunch.rows: power of two >= 1 or None, got {self.rows}")

    def rows_per_program(self, r: int) -> int:
        if self.rows is not None:
            return self.rows
        return triton.next_power_of_2(r) if interpreting() else 1


# --- kernel ----------------------------------------------------------------------------------


@triton.jit
def _load_rounded(ptrs, mask, stride_s, S: tl.constexpr, VOLATILE: tl.constexpr):
    """qkv at ptrs as fp32 on the bf16 grid: partials summed s = 0 … S−1, rounded. VOLATILE:
    the partials were stored by other programs of this launch (kernels/arrival.py)."""
    v = tl.load(ptrs, mask=mask, other=0.0, volatile=VOLATILE).to(tl.float32)
    for s in tl.static_range(1, S):
        v += tl.load(ptrs + s * stride_s, mask=mask, other=0.0, volatile=VOLATILE)
    return bf16_rne(v).to(tl.float32)


@triton.jit
def _rounded_product(a, b, INTERPRET: tl.constexpr):
    """a · b rounded to FP32 whatever the launch's enable_fp_fusion: PTX mul.rn is never
    contracted into an FMA with the add that follows (the interpreter's NumPy never
    contracts)."""
    if INTERPRET:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def qk_rope_rows(
    qkv_ptr, qw_ptr, kw_ptr, pos_ptr, tab_ptr, q_ptr, k_ptr, v_ptr, ck_ptr, cv_ptr, label_ptr,
    rows, n_rows, head, P, C, eps,
    stride_s, stride_r, stride_c, stride_tp,
    stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
    s_cc, s_ch, s_vc, s_vch,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
    S: tl.constexpr, NORM: tl.constexpr, WRITE_KV: tl.constexpr, RING: tl.constexpr,
    BLOCK_D: tl.constexpr, VOLATILE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Head `head` ([0, HQ) q, [HQ, HQ + HKV) k, then v) of the rows `rows` [BR] below n_rows:
    norm, RoPE, the q / k / v stores and (WRITE_KV) the cache's. Every value is per row, so a
    row's bits do not depend on which rows share the program."""
    half: tl.constexpr = ROT // 2
    live = rows < n_rows  # [BR]
    d = tl.arange(0, BLOCK_D)  # [BD]
    dm = d < D
    m2 = live[:, None] & dm[None, :]  # [BR, BD]
    pos = tl.load(pos_ptr + rows, mask=live, other=-1)  # [BR]
    # WRITE_KV: the row's cache slot, as kernels/kv_cache.py _write_kv_kernel finds it; a
    # negative position or one without a slot (full cache, pos ≥ C) stores nothing
    if RING:
        slot = pos % C
    else:
        slot = pos
    stored = live & (pos >= 0) & (slot < C)
    slot64 = slot.to(tl.int64)
    base = qkv_ptr + rows[:, None] * stride_r + head * D * stride_c  # [BR, 1]
    x = _load_rounded(base + d[None, :] * stride_c, m2, stride_s, S, VOLATILE)  # [BR, BD]
    if head >= HQ + HKV:
        vh = head - HQ - HKV
        tl.store(v_ptr + rows[:, None] * stride_vr + vh * stride_vh + d[None, :],
                 x.to(tl.bfloat16), mask=m2)
        if WRITE_KV:
            tl.store(cv_ptr + slot64[:, None] * s_vc + vh * s_vch + d[None, :],
                     x.to(tl.bfloat16), mask=m2 & stored[:, None])
    else:
        is_q = head < HQ
        # NeoX rotate-half partner of dim d: d ± rot/2 inside the rotary part, itself outside
        partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
        xp = _load_rounded(base + partner[None, :] * stride_c, m2, stride_s, S, VOLATILE)
        if NORM:
            w = tl.where(is_q, tl.load(qw_ptr + d, mask=dm, other=0.0),
                         tl.load(kw_ptr + d, mask=dm, other=0.0)).to(tl.float32)
            wp = tl.where(is_q, tl.load(qw_ptr + partner, mask=dm, other=0.0),
                          tl.load(kw_ptr + partner, mask=dm, other=0.0)).to(tl.float32)
            x64 = x.to(tl.float64)
            ss = tl.sum(x64 * x64, axis=1).to(tl.float32)  # [BR]; bf16 squares exact in FP64
            mean = tl.div_rn(ss[:, None] + tl.zeros_like(x), tl.zeros_like(x) + D)
            r = tl.div_rn(tl.zeros_like(x) + 1.0, tl.sqrt_rn(mean + eps))
            x = bf16_rne(x * r * w[None, :]).to(tl.float32)
            xp = bf16_rne(xp * r * wp[None, :]).to(tl.float32)
        ok = (pos >= 0) & (pos < P)  # [BR]
        rm = d < ROT
        j = tl.where(d < half, d, d - half)
        tab = tab_ptr + pos[:, None] * stride_tp + j[None, :]
        tm = rm[None, :] & (ok & live)[:, None]
        cos = tl.load(tab, mask=tm, other=0.0)
        sin = tl.load(tab + half, mask=tm, other=0.0)
        signed = tl.where(d < half, -xp, xp)  # first half: x1·cos − x2·sin
        y = _rounded_product(x, cos, INTERPRET) + _rounded_product(signed, sin, INTERPRET)
        y = tl.where(rm[None, :], y, x)
        y = bf16_rne(tl.where(ok[:, None], y, float("nan")))
        if is_q:
            tl.store(q_ptr + rows[:, None] * stride_qr + head * stride_qh + d[None, :], y,
                     mask=m2)
        else:
            kh = head - HQ
            tl.store(k_ptr + rows[:, None] * stride_kr + kh * stride_kh + d[None, :], y,
                     mask=m2)
            if WRITE_KV:
                tl.store(ck_ptr + slot64[:, None] * s_cc + kh * s_ch + d[None, :], y,
                         mask=m2 & stored[:, None])
                if head == HQ:  # one label per row: the first k head writes it
                    tl.store(label_ptr + slot64, pos, mask=stored)


@triton.jit
def _qk_rope_kernel(
    qkv_ptr, qw_ptr, kw_ptr, pos_ptr, tab_ptr, n_live_ptr, q_ptr, k_ptr, v_ptr,
    ck_ptr, cv_ptr, label_ptr,  # WRITE_KV: the layer's cache K, V [C, Hkv, D], slot_pos [C]
    R, P, C, eps,
    stride_s, stride_r, stride_c, stride_tp,
    stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
    s_cc, s_ch, s_vc, s_vch,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
    S: tl.constexpr, NORM: tl.constexpr, WRITE_KV: tl.constexpr, RING: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n_rows = tl.minimum(tl.load(n_live_ptr), R)
    row0 = tl.program_id(0) * BLOCK_R
    if row0 >= n_rows:
        return
    qk_rope_rows(qkv_ptr, qw_ptr, kw_ptr, pos_ptr, tab_ptr, q_ptr, k_ptr, v_ptr, ck_ptr, cv_ptr,
                 label_ptr, row0 + tl.arange(0, BLOCK_R), n_rows, tl.program_id(1), P, C, eps,
                 stride_s, stride_r, stride_c, stride_tp, stride_qr, stride_qh, stride_kr,
                 stride_kh, stride_vr, stride_vh, s_cc, s_ch, s_vc, s_vch,
                 HQ, HKV, D, ROT, S, NORM, WRITE_KV, RING, BLOCK_D, False, INTERPRET)


@triton.jit
def _qkv_rope_kernel(
    xq_ptr, sx_ptr, w_ptr, ws_ptr, n_live_ptr, parts_ptr, cnt_ptr,
    qw_ptr, kw_ptr, pos_ptr, tab_ptr, q_ptr, k_ptr, v_ptr, ck_ptr, cv_ptr, label_ptr,
    R, N, P, C, eps,
    stride_xr, stride_sxr, stride_wn, stride_wk, stride_sn, stride_sk, stride_ps, stride_pr,
    stride_tp, stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
    s_cc, s_ch, s_vc, s_vch,
    K: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_HEADS: tl.constexpr, ARRIVALS: tl.constexpr,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
    S: tl.constexpr, NORM: tl.constexpr, WRITE_KV: tl.constexpr, RING: tl.constexpr,
    BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr, HOIST: tl.constexpr, EARLY: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    """Program (tile, split) of the QKV projection (kernels/linear.py's FP8 program, its FP32
    partial stored), then an arrival on its head group's counter: a group is GROUP_HEADS heads
    (whole tiles of ≥ one head), ARRIVALS = its tiles × S programs; the last to arrive runs
    the standalone kernel's code on the group's heads for every row at once, reading the
    partials the others stored (volatile)."""
    if PREFETCH:  # before the PDL wait: the weights are no predecessor's output
        prefetch_weights(w_ptr, N, K, stride_wn, stride_wk, KB, BLOCK_N)
    pdl_enter(PDL)
    rows, n_rows = fp8_program(xq_ptr, sx_ptr, w_ptr, ws_ptr, n_live_ptr, parts_ptr, R, N,
                               stride_xr, stride_sxr, stride_wn, stride_wk, stride_sn,
                               stride_sk, stride_ps, stride_pr, 1, K, KB, BLOCK_N, BLOCK_R,
                               False, HOIST, EARLY)
    group = tl.program_id(0) * BLOCK_N // (GROUP_HEADS * D)
    if last_arrival(cnt_ptr + group, ARRIVALS):
        for h in tl.static_range(GROUP_HEADS):
            head = group * GROUP_HEADS + h
            if head < HQ + 2 * HKV:
                qk_rope_rows(parts_ptr, qw_ptr, kw_ptr, pos_ptr, tab_ptr, q_ptr, k_ptr, v_ptr,
                             ck_ptr, cv_ptr, label_ptr, rows, n_rows, head, P, C, eps,
                             stride_ps, stride_pr, 1, stride_tp, stride_qr, stride_qh,
                             stride_kr, stride_kh, stride_vr, stride_vh, s_cc, s_ch, s_vc,
                             s_vch, HQ, HKV, D, ROT, S, NORM, WRITE_KV, RING, BLOCK_D, True,
                             INTERPRET)


# --- wrapper -----------------------------------------------------------------------------------


def _check_kv_cache(cache: LayerKV, r: int, kv_heads: int, d: int, positions, device) -> None:
    """The checks kernels.kv_cache.write_kv makes before storing k, v [R, Hkv, D] bf16 at
    positions [R] int32 into cache; ValueError naming the argument."""
    check_cache(cache, "qk_rope")
    lay = cache.layout
    if (lay.kv_heads, lay.head_dim) != (kv_heads, d):
        raise ValueError(f"cache.layout: qk_rope stores k, v [R, {kv_heads}, {d}], the cache "
                         f"holds [C, {lay.kv_heads}, {lay.head_dim}]")
    for name, t in (("cache.k", cache.k), ("cache.v", cache.v), ("cache.slot_pos",
                                                                  cache.slot_pos)):
        if t.device != device:
            raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if cache.k.dtype != torch.bfloat16:
        raise ValueError(f"cache.k: expected dtype torch.bfloat16 (k, v are bf16), got "
                         f"{cache.k.dtype}")
    if positions.dtype != torch.int32:
        raise ValueError(f"positions: expected dtype torch.int32 with a cache (its labels), got "
                         f"{positions.dtype}")
    if r > lay.capacity:
        raise ValueError(f"cache: {r} rows exceed its {lay.capacity} slots")


def _head_out(name, t, r, heads, d, device):
    if t is None:
        return torch.empty(r, heads, d, dtype=torch.bfloat16, device=device)
    check_tensor(name, t, shape=(r, heads, d), dtypes=(torch.bfloat16,), device=device)
    if t.stride(2) != 1:
        raise ValueError(f"{name}: expected unit stride in the head dim, got {t.stride()}")
    return t


@twin(_twins.qk_rope_ref)
def qk_rope(
    qkv: torch.Tensor,  # [R, W] bf16, or [S, R, W] fp32 split-K partials (linear_fp8_partials)
    q_norm_weight: torch.Tensor | None,  # [D] bf16 / fp32; None (with k) = no QK-norm
    k_norm_weight: torch.Tensor | None,  # [D]
    positions: torch.Tensor,  # [R] int32 / int64 device; rows ≥ n never read
    table: RopeTable,
    n_live: torch.Tensor | None = None,  # device int32 [1]; None = all R rows
    *,
    num_q_heads: int,
    num_kv_heads: int,
    eps: float,
    q_out: torch.Tensor | None = None,  # [R, Hq, D] bf16, unit stride in D
    k_out: torch.Tensor | None = None,  # [R, Hkv, D] bf16
    v_out: torch.Tensor | None = None,  # [R, Hkv, D] bf16
    config: QkRopeLaunch | None = None,
    cache: LayerKV | None = None,  # K, V [C, Hkv, D] bf16, slot_pos [C]; positions int32
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ q [R, Hq, D], k [R, Hkv, D], v [R, Hkv, D] bf16; rows ≥ n untouched. With a cache the
    same launch stores the live rows' k and v in it as kernels.kv_cache.write_kv(cache, k, v,
    positions, n) does: at slot(position) with the position as label (module docstring of
    kernels/kv_cache.py), nothing for a negative position or one without a slot.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() not in (2, 3):
        raise ValueError("qkv: expected [R, W] bf16 or [S, R, W] fp32 partials, got "
                         f"{getattr(qkv, 'shape', type(qkv).__name__)}")
    want = torch.bfloat16 if qkv.dim() == 2 else torch.float32
    check_tensor("qkv", qkv, dtypes=(want,))
    s = 1 if qkv.dim() == 2 else qkv.shape[0]
    r = qkv.shape[-2]
    call = _prepare(qkv.shape[-1], r, qkv.device, q_norm_weight, k_norm_weight, positions,
                    table, n_live, num_q_heads, num_kv_heads, eps, q_out, k_out, v_out, cache)
    if r == 0:
        return call.q, call.k, call.v
    cfg = config or QkRopeLaunch()
    block_r = cfg.rows_per_program(r)
    _qk_rope_kernel[(triton.cdiv(r, block_r), call.heads)](
        qkv, *call.pointers[:4], call.n, *call.pointers[4:],
        r, table.positions, call.capacity, float(eps),
        qkv.stride(0) if s > 1 else 0, qkv.stride(-2), qkv.stride(-1), *call.strides,
        S=s, BLOCK_R=block_r, **call.constexprs,
        num_warps=cfg.num_warps, **launch_opts(pdl, enable_fp_fusion=False),
    )
    return call.q, call.k, call.v


@dataclass(frozen=True)
class _Prepared:
    """What both launches pass for the rope part, checked."""

    n: torch.Tensor  # live rows, device int32 [1]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    heads: int  # Hq + 2·Hkv
    capacity: int  # the cache's slots (1 without a cache)
    pointers: tuple  # qw, kw, positions, table, q, k, v, cache K, cache V, labels
    strides: tuple  # table row, q / k / v rows and heads, cache K / V slots and heads
    constexprs: dict


def _prepare(width, r, dev, q_norm_weight, k_norm_weight, positions, table, n_live,
             num_q_heads, num_kv_heads, eps, q_out, k_out, v_out, cache) -> _Prepared:
    """The checks of every argument but qkv (ValueError naming it) and the launch's rope
    arguments."""
    if num_q_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"num_q_heads / num_kv_heads: expected >= 1, got {num_q_heads} / "
                         f"{num_kv_heads}")
    heads = num_q_heads + 2 * num_kv_heads
    if width % heads:
        raise ValueError(f"qkv: width {width} is not (num_q_heads + 2·num_kv_heads) = {heads} "
                         "times the head dim")
    d = width // heads
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight / k_norm_weight: give both or neither")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            check_tensor(name, w, shape=(d,), dtypes=(torch.bfloat16, torch.float32), device=dev)
    check_tensor("positions", positions, shape=(r,), dtypes=(torch.int32, torch.int64),
                 device=dev)
    if not isinstance(table, RopeTable):
        raise ValueError(f"table: expected a RopeTable (kernels.qk_rope.rope_table), got "
                         f"{type(table).__name__}")
    rot = table.rotary_dim
    if rot > d:
        raise ValueError(f"table.rotary_dim: {rot} exceeds the head dim {d}")
    check_tensor("table.cos_sin", table.cos_sin, shape=(None, rot), dtypes=(torch.float32,),
                 device=dev)
    if table.cos_sin.stride(1) != 1:
        raise ValueError(f"table.cos_sin: expected unit column stride, got "
                         f"{table.cos_sin.stride()}")
    if not eps > 0:
        raise ValueError(f"eps: expected > 0, got {eps}")
    if cache is not None:
        _check_kv_cache(cache, r, num_kv_heads, d, positions, dev)
    n = live_count(n_live, r, dev)
    q = _head_out("q_out", q_out, r, num_q_heads, d, dev)
    k = _head_out("k_out", k_out, r, num_kv_heads, d, dev)
    v = _head_out("v_out", v_out, r, num_kv_heads, d, dev)
    qw = q_norm_weight if q_norm_weight is not None else table.cos_sin  # unread when NORM=False
    kw = k_norm_weight if k_norm_weight is not None else table.cos_sin
    ck, cv, labels = (k, v, positions) if cache is None else (cache.k, cache.v, cache.slot_pos)
    return _Prepared(
        n, q, k, v, heads, 1 if cache is None else cache.layout.capacity,
        (qw, kw, positions, table.cos_sin, q, k, v, ck, cv, labels),
        (table.cos_sin.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
         v.stride(0), v.stride(1), ck.stride(0), ck.stride(1), cv.stride(0), cv.stride(1)),
        dict(HQ=num_q_heads, HKV=num_kv_heads, D=d, ROT=table.rotary_dim,
             NORM=q_norm_weight is not None, WRITE_KV=cache is not None,
             RING=cache is not None and cache.layout.ring, BLOCK_D=triton.next_power_of_2(d),
             INTERPRET=interpreting()),
    )


MAX_GROUPS = 256  # head groups of one folded launch (QkvRopeScratch's counters)


@dataclass(frozen=True)
class QkvRopeScratch:
    """The folded launch's per-head-group arrival counters; made once per device, reused by every
    call (a captured graph replays it)."""

    counters: torch.Tensor  # [MAX_GROUPS] int32, 0 between launches (kernels/arrival.py)

    @classmethod
    def create(cls, device) -> QkvRopeScratch:
        return cls(torch.zeros(MAX_GROUPS, dtype=torch.int32, device=device))

    def reset(self) -> None:
        """After an aborted launch (device synchronized): every counter 0."""
        self.counters.zero_()


@twin(_twins.qkv_rope_ref)
def qkv_rope(
    x: torch.Tensor,  # [R, H] bf16 / fp16 / fp32, any strides; rows ≥ n may hold anything
    weight: torch.Tensor,  # [W, H] E4M3, W = (Hq + 2·Hkv)·D
    scale_inv: torch.Tensor,  # [⌈W/128⌉, ⌈H/128⌉] fp32
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    positions: torch.Tensor,
    table: RopeTable,
    n_live: torch.Tensor | None = None,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    eps: float,
    scratch: QkvRopeScratch,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,  # quantize_act(x) made earlier
    partials: torch.Tensor | None = None,  # [S, R, W] fp32 workspace
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    config: LinearLaunch | None = None,
    cache: LayerKV | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.linear.linear_fp8_partials then qk_rope on its partials, in one launch →
    (partials [S, R, W], q, k, v): the same bits as the two launches (the partials are the
    linear's programs' own; the last program of each head group to store runs qk_rope's row
    code, module docstring of kernels/arrival.py). The weight's channel tile and the head dim
    must divide one another (both powers of two). Arguments as the two wrappers'."""
    r, k, width, cfg, (s, kb) = _check_fp8_args(x, weight, scale_inv, config)
    check_prefetch(cfg, pdl)
    call = _prepare(width, r, x.device, q_norm_weight, k_norm_weight, positions, table, n_live,
                    num_q_heads, num_kv_heads, eps, q_out, k_out, v_out, cache)
    d = width // call.heads
    if d & (d - 1) or max(d, cfg.block_n) % min(d, cfg.block_n):
        raise ValueError(f"qkv_rope: the head dim {d} and the weight's channel tile "
                         f"{cfg.block_n} must divide one another (powers of two)")
    group_heads = max(1, cfg.block_n // d)
    groups = -(-call.heads // group_heads)
    if not isinstance(scratch, QkvRopeScratch) or scratch.counters.device != x.device:
        raise ValueError(f"scratch: expected a QkvRopeScratch on {x.device}")
    if groups > scratch.counters.numel():
        raise ValueError(f"qkv_rope: {groups} head groups exceed the scratch's "
                         f"{scratch.counters.numel()} counters")
    xq, sx = (quantize_act(x, call.n, pdl=pdl) if quantized is None
              else check_quantized("quantized", quantized, r, k, x.device))
    parts = _partials_buffer(partials, s, r, width, x.device)
    _qkv_rope_kernel[(triton.cdiv(width, cfg.block_n), s)](
        xq, sx, weight, scale_inv, call.n, parts, scratch.counters, *call.pointers,
        r, width, table.positions, call.capacity, float(eps),
        xq.stride(0), sx.stride(0), *weight.stride(), *scale_inv.stride(), parts.stride(0),
        parts.stride(1), *call.strides,
        K=k, KB=kb, BLOCK_N=cfg.block_n, BLOCK_R=BLOCK_R, GROUP_HEADS=group_heads,
        ARRIVALS=group_heads * d // cfg.block_n * s, S=s, HOIST=cfg.hoist_scales,
        EARLY=cfg.early_loads, PREFETCH=cfg.prefetch_w,
        **call.constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_opts(pdl),
    )
    return parts, call.q, call.k, call.v
