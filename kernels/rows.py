"""Row kernels for the runtime parts that had no kernel (layer 0's SwiGLU tail, the draft's norms,
FP32 residual and BF16 router). The norms and SwiGLU run one program per live row, so a row's
bits never depend on its batch-mates or on the buffer width, and rows ≥ n_live are neither read
nor written; the router runs one program per block of experts over all (≤ 8) rows — a row's
logit is still one dot product in a fixed order, whatever the other rows.

  norm_rows      y = rms(a [+ rms(b, wb)], w)  — optionally storing the sum s = a + rms(b, wb)
                 (rounded to s's dtype) and/or y; covers rms of one tensor, the residual add of
                 layer 0 and of the draft (BF16 or FP32 residual) and a norm of the sum.
  silu_mul_rows  act = bf16(silu(g) · u) of layer 0's dense FFN.
  route_rows     the draft's FP32 router on a BF16 input: softmax → top-k (ties: lower index) →
                 renormalize (reference.ops.route), by kernels/router.py `_route_kernel`.
                 (One program per row reading the whole 3 MB router each costs 185 µs per call
                 at the IQuest rank shape on the H200, 0.92 ms of an 11.04 ms round: row 9fb341f
                 of the History table in reports/benchmarks/rank-h200/README.md; raw record:
                 git show a1c89d8:reports/benchmarks/rank-h200/earlier-9fb341f/record.json.)
Twins: reference.ops.rms_norm / route and the torch expressions of reference/model.py, applied
one row at a time by iquestrt/ops.py TwinOps. Rounding points as there; bf16 stores round to
nearest even by hand (the interpreter's cast truncates), 1/sqrt and means use IEEE division.
What remains vs the twins: the order of each sum of squares and of the router's dot products,
and exp (tolerance rows kernels.rows.* in qualification/tolerances.py).

Dimension letters: R rows, H hidden, E experts, K top-k, F dense intermediate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_tensor, live_count
from kernels.launch import launch_opts, pdl_enter
from kernels.router import RouteScratch, _route_kernel, route_launch
from kernels.tails import _bf16, _rms
from kernels.twin import twin
from reference.twins import rows as _twins

_COMPILE = dict(enable_fp_fusion=False)


@triton.jit
def _norm_rows_kernel(
    a_ptr, b_ptr, wb_ptr, w_ptr, s_ptr, y_ptr, n_live_ptr,
    stride_a, stride_b, stride_s, stride_y, eps,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, HAS_B: tl.constexpr, SUM_BF16: tl.constexpr,
    STORE_S: tl.constexpr, HAS_W: tl.constexpr, Y_BF16: tl.constexpr, B_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    if row >= tl.load(n_live_ptr):
        return
    cols = tl.arange(0, BLOCK_H)
    m = cols < HIDDEN
    s = tl.load(a_ptr + row * stride_a + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + row * stride_b + cols, mask=m, other=0.0).to(tl.float32)
        wb = tl.load(wb_ptr + cols, mask=m, other=0.0).to(tl.float32)
        t = _rms(b, wb, eps, HIDDEN)
        if B_BF16:  # rms_norm of a bf16 tensor returns bf16
            t = _bf16(t)
        s = s + t
        if SUM_BF16:
            s = _bf16(s)
        if STORE_S:
            if SUM_BF16:
                tl.store(s_ptr + row * stride_s + cols, s.to(tl.bfloat16), mask=m)
            else:
                tl.store(s_ptr + row * stride_s + cols, s, mask=m)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        y = _rms(s, w, eps, HIDDEN)
        if Y_BF16:
            tl.store(y_ptr + row * stride_y + cols, _bf16(y).to(tl.bfloat16), mask=m)
        else:
            tl.store(y_ptr + row * stride_y + cols, y, mask=m)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_live_ptr, stride_g, stride_u, stride_o,
                     F: tl.constexpr, BLOCK_F: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    if row >= tl.load(n_live_ptr):
        return
    c = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = c < F
    g = tl.load(g_ptr + row * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + c, mask=m, other=0.0).to(tl.float32)
    silu = tl.div_rn(g, 1.0 + tl.exp(-g))
    tl.store(out_ptr + row * stride_o + c, _bf16(silu * u).to(tl.bfloat16), mask=m)


def _rows_2d(name: str, t: torch.Tensor, rows: int, cols: int, dtypes) -> None:
    check_tensor(name, t, dims=2, dtypes=dtypes)
    if t.shape != (rows, cols) or t.stride(1) != 1:
        raise ValueError(f"kernels.rows: {name} must be [{rows}, {cols}] with unit column "
                         f"stride, got shape {tuple(t.shape)} strides {t.stride()}")


@twin(_twins.norm_rows_ref)
def norm_rows(
    a: torch.Tensor,  # [R, H] bf16 | fp32
    w: torch.Tensor | None,  # [H] the final norm's weight; None: no y
    n_live: torch.Tensor,  # device int32 [1]
    eps: float,
    *,
    b: torch.Tensor | None = None,  # [R, H] bf16 | fp32: s = a + rms(b, wb)
    wb: torch.Tensor | None = None,  # [H]
    sum_dtype: torch.dtype = torch.float32,  # s is rounded to this (bf16 or fp32)
    store_sum: bool = False,
    y_out: torch.Tensor | None = None,  # [R, H] (may be a strided column slice)
    y_dtype: torch.dtype = torch.bfloat16,
    pdl: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """→ (s [R, H] or None, y [R, H] or None); rows ≥ n_live untouched.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    R, H = a.shape
    dev = a.device
    _rows_2d("a", a, R, H, (torch.bfloat16, torch.float32))
    n = live_count(n_live, R, dev)
    if (b is None) != (wb is None):
        raise ValueError("kernels.rows.norm_rows: b and wb go together")
    if b is not None:
        _rows_2d("b", b, R, H, (torch.bfloat16, torch.float32))
    if sum_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"kernels.rows.norm_rows: sum_dtype bf16 or fp32, got {sum_dtype}")
    if store_sum and b is None:
        raise ValueError("kernels.rows.norm_rows: store_sum needs b")
    s = torch.empty(R, H, dtype=sum_dtype, device=dev) if store_sum else None
    y = None
    if w is not None:
        y = y_out if y_out is not None else torch.empty(R, H, dtype=y_dtype, device=dev)
        _rows_2d("y_out", y, R, H, (torch.bfloat16, torch.float32))
    dummy = a
    _norm_rows_kernel[(R,)](
        a, b if b is not None else dummy, wb if wb is not None else dummy,
        w if w is not None else dummy, s if s is not None else dummy,
        y if y is not None else dummy, n,
        a.stride(0), b.stride(0) if b is not None else 0, s.stride(0) if s is not None else 0,
        y.stride(0) if y is not None else 0, float(eps),
        HIDDEN=H, BLOCK_H=triton.next_power_of_2(H), HAS_B=b is not None,
        SUM_BF16=sum_dtype == torch.bfloat16, STORE_S=store_sum, HAS_W=w is not None,
        Y_BF16=y is not None and y.dtype == torch.bfloat16,
        B_BF16=b is not None and b.dtype == torch.bfloat16, num_warps=4,
        **launch_opts(pdl, **_COMPILE),
    )
    return s, y


@twin(_twins.silu_mul_rows_ref)
def silu_mul_rows(g: torch.Tensor, u: torch.Tensor, n_live: torch.Tensor, *,
                  pdl: bool = False) -> torch.Tensor:
    """g, u [R, F] bf16 → act [R, F] bf16 = bf16(silu(g) · u); rows ≥ n_live untouched.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    R, F = g.shape
    _rows_2d("g", g, R, F, (torch.bfloat16,))
    _rows_2d("u", u, R, F, (torch.bfloat16,))
    n = live_count(n_live, R, g.device)
    out = torch.empty_like(g)
    block = min(1024, triton.next_power_of_2(F))
    _silu_mul_kernel[(R, triton.cdiv(F, block))](g, u, out, n, g.stride(0), u.stride(0),
                                                 out.stride(0), F=F, BLOCK_F=block, num_warps=4,
                                                 **launch_opts(pdl, **_COMPILE))
    return out


@twin(_twins.route_rows_ref)
def route_rows(x: torch.Tensor, router_w: torch.Tensor, top_k: int, n_live: torch.Tensor, *,
               scratch: RouteScratch | None = None, pdl: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R ≤ 8, H] bf16 | fp32, router_w [E, H] → (weights [R, K] fp32, ids [R, K] int32); rows ≥
    n_live hold NaN / −1, and so does a live row whose logits are not finite (scratch.flag is
    raised). One launch of ⌈E / block_e⌉ programs over expert blocks (kernels/router.py
    `_route_kernel`); scratch: its logits and arrival counter (made here when None — the
    runtime keeps one per router shape, so a captured round allocates nothing).
    pdl: programmatic dependent launch (kernels/launch.py)."""
    R, H = x.shape
    _rows_2d("x", x, R, H, (torch.bfloat16, torch.float32))
    E = router_w.shape[0]
    _rows_2d("router_w", router_w, E, H, (torch.bfloat16, torch.float32))
    if not router_w.is_contiguous():
        raise ValueError("kernels.rows.route_rows: router_w must be contiguous")
    if not 1 <= top_k <= min(E, 64):
        raise ValueError(f"kernels.rows.route_rows: top_k in [1, min(E={E}, 64)], got {top_k}")
    cfg = route_launch(H, E)
    if R > cfg.route_rows:
        raise ValueError(f"kernels.rows.route_rows: x has {R} rows, at most {cfg.route_rows}")
    scratch = scratch or RouteScratch.create(E, x.device, cfg.route_rows)
    check_tensor("scratch.logits", scratch.logits, shape=(cfg.route_rows, E),
                 dtypes=(torch.float32,), device=x.device)
    n = live_count(n_live, R, x.device)
    ids = torch.empty(R, top_k, dtype=torch.int32, device=x.device)  # every row is written
    wts = torch.empty(R, top_k, dtype=torch.float32, device=x.device)
    grid = triton.cdiv(E, cfg.block_e)
    _route_kernel[(grid,)](
        x, router_w, scratch.logits, scratch.counter, ids, wts, scratch.flag, n, x.stride(0),
        ids.stride(0), wts.stride(0), grid, R, HIDDEN=H, EXPERTS=E,
        BLOCK_EALL=triton.next_power_of_2(E), TOP_K=top_k,
        BLOCK_TOPK=triton.next_power_of_2(top_k), ROUTE_ROWS=cfg.route_rows,
        BLOCK_E=cfg.block_e, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        **launch_opts(pdl, **_COMPILE),
    )
    return wts, ids
