"""Twins of kernels/rows.py: the row parts of the draft and the dense layer — the residual sum +
RMS norm(s), SiLU·mul and the router — as reference/model.py writes them, one live row at a time
(the kernels are batch-invariant; torch's CPU ops are kept so by calling them per row).

Dimension letters: R rows in the buffer, n live rows, H hidden, F dense width, E experts,
K top-k.
"""

from __future__ import annotations

import torch

from reference import ops
from reference.twins.kv_cache import as_int

NAN = float("nan")


def live_count(n_live, rows: int) -> int:
    """n_live (host int or device [1] tensor) as a host int, at most rows."""
    return min(as_int(n_live), rows)


def norm_rows_ref(a: torch.Tensor, w: torch.Tensor | None, n_live, eps: float, *,
                  b: torch.Tensor | None = None, wb: torch.Tensor | None = None,
                  sum_dtype: torch.dtype = torch.float32, store_sum: bool = False,
                  y_out: torch.Tensor | None = None, y_dtype: torch.dtype = torch.bfloat16):
    """s = a (+ rms_norm(b, wb)) in sum_dtype, y = rms_norm(s, w) → (s [R, H] if store_sum,
    y [R, H] if w) — the kernel's outputs, padding rows NaN (y_out's padding rows untouched)."""
    rows = a.shape[0]
    s_out = torch.full(a.shape, NAN, dtype=sum_dtype, device=a.device) if store_sum else None
    y = None
    if w is not None:
        y = y_out if y_out is not None else torch.full(a.shape, NAN, dtype=y_dtype,
                                                       device=a.device)
    for r in range(live_count(n_live, rows)):
        s_r = a[r : r + 1]
        if b is not None:
            t = ops.rms_norm(b[r : r + 1], wb, eps)
            s_r = (s_r.float() + t.float()).to(sum_dtype)
            if store_sum:
                s_out[r : r + 1] = s_r
        if y is not None:
            y[r : r + 1] = ops.rms_norm(s_r, w, eps, y.dtype)
    return s_out, y


def silu_mul_rows_ref(g: torch.Tensor, u: torch.Tensor, n_live) -> torch.Tensor:
    """g, u [R, F] bf16 → the live rows' bf16(silu(g) · u) [n, F]."""
    n = live_count(n_live, g.shape[0])
    return torch.cat([ops.silu_mul(g[r : r + 1], u[r : r + 1], torch.bfloat16)
                      for r in range(n)])


def route_rows_ref(x: torch.Tensor, router_w: torch.Tensor, top_k: int, n_live):
    """x [R, H], router_w [E, H] → the live rows' (weights [n, K] FP32 renormalized,
    ids [n, K] int32)."""
    outs = [ops.route(x[r : r + 1], router_w, top_k)
            for r in range(live_count(n_live, x.shape[0]))]
    return (torch.cat([o[0] for o in outs]),
            torch.cat([o[1] for o in outs]).to(torch.int32))
