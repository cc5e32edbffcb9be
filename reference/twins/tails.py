"""Twins of kernels/tails.py: the residual + RMSNorm tails of a layer ≥ 1, with the rank-partial
sum, NaN readiness and the folded router, in plain torch from reference/ops.py.

Rounding points are those of reference/model.py (Precision "bf16-fold"):
  attention tail  a = bf16(Σ_n partials[n])          (the o_proj output; n in order, FP32)
                  an = bf16(rms_norm(a, attn_out_norm))
                  h32 = xn + an·attn_out_scale (FP32),  h = bf16(h32)
                  f_in = bf16(rms_norm(h, feed_forward_norm))
                  router on rms_norm(h32, feed_forward_norm) in FP32 (not the rounded f_in)
  MoE tail        f = bf16(Σ_n partials[n])           (the experts' output)
                  x = bf16(h + f·ffn_out_scale),  xn' = bf16(rms_norm(x, next_norm))
                  (next_norm: the next layer's attention_norm, or the final norm).
Partials are FP32 in the runtime: the reference rounds a and f once, after the full sum; BF16
partials are accepted too (one more rounding each, on the producer's side).

Readiness, per row program as in the kernel: row r < n_live is ready iff its FP32 sum has no NaN;
a padding row r ≥ n_live stands in with row 0 (it needs the evidence, not the data). A row that is
not ready gets NaN outputs (ids −1, weights NaN) and sets fail_flag to 1; a ready row program
re-arms its row of `rearm` with NaN. The twin looks once: a NaN present at the call never becomes
ready (max_polls is accepted and ignored; the kernels' scratch, out, polls and config have no
twin).

Twins return live rows only ([n, …]); the kernels leave padding rows untouched.
Dimension letters: N partials (ranks), R rows in the buffer, n live rows, H hidden, E experts,
K top-k.
"""

from __future__ import annotations

import torch

from reference import ops
from reference.op_types import AttnTailOut, MoeTailOut

NAN = float("nan")


def n_live_of(n_live, rows: int) -> int:
    n = int(torch.as_tensor(n_live).reshape(-1)[0].item())
    if not 1 <= n <= rows:
        raise ValueError(f"n_live: expected 1..{rows} live rows, got {n}")
    return n


def partial_sum(partials: torch.Tensor, n: int) -> torch.Tensor:
    """Σ_n partials[n, :n_live] in FP32, n = 0, 1, … in order (the kernel's pinned order)."""
    acc = partials[0, :n].float()
    for p in partials[1:]:
        acc = acc + p[:n].float()
    return acc  # [n, H]


def readiness(partials: torch.Tensor, n: int, fail_flag, rearm):
    """→ (FP32 sums of the live rows [n, H], ok [n] bool); applies the flag and re-arm effects."""
    acc = partial_sum(partials, n)
    ok = ~torch.isnan(acc).any(-1)  # [n]
    rows = partials.shape[1]
    ok_all = torch.cat([ok, ok[:1].expand(rows - n)])  # padding row programs poll row 0
    if fail_flag is not None and not bool(ok_all.all()):
        fail_flag.fill_(1)
    if rearm is not None:
        rearm[ok_all.to(rearm.device)] = NAN
    return acc, ok


def _fail_rows(t: torch.Tensor, ok: torch.Tensor, value) -> torch.Tensor:
    return torch.where(ok.reshape(-1, *([1] * (t.dim() - 1))), t, torch.full_like(t, value))


def _attn_h32(acc: torch.Tensor, xn, attn_out_norm, eps: float, attn_out_scale: float):
    """a = bf16(Σ), an = bf16(rms_norm(a)), h32 = xn + an·scale (FP32) for the live rows."""
    a = acc.to(torch.bfloat16)
    an = ops.rms_norm(a, attn_out_norm.cpu(), eps)
    return xn[: acc.shape[0]].cpu().float() + an.float() * attn_out_scale


def attn_tail_ref(
    partials: torch.Tensor,  # [N, R, H] fp32 | bf16 o_proj partials; NaN = not yet written
    xn: torch.Tensor,  # [R, H] bf16 this layer's normalized input (the residual base)
    attn_out_norm: torch.Tensor,  # [H]
    ffn_norm: torch.Tensor,  # [H] feed_forward_norm
    n_live,  # [1] int32 (or int)
    fail_flag: torch.Tensor | None = None,  # [1] int32, set to 1 when a row is not ready
    *,
    eps: float,
    attn_out_scale: float,
    max_polls: int = 1,
    rearm: torch.Tensor | None = None,  # [R, H] filled with NaN by ready row programs
    router_w: torch.Tensor | None = None,  # [E, H] fp32
    top_k: int = 0,
) -> AttnTailOut:
    n = n_live_of(n_live, partials.shape[1])
    acc, ok = readiness(partials.cpu(), n, fail_flag, rearm)
    h32 = _attn_h32(acc, xn, attn_out_norm, eps, attn_out_scale)
    h = h32.to(torch.bfloat16)
    f_in = ops.rms_norm(h, ffn_norm.cpu(), eps)
    out = AttnTailOut(_fail_rows(h, ok, NAN), _fail_rows(f_in, ok, NAN))
    if router_w is not None:
        r_in = ops.rms_norm(h32, ffn_norm.cpu(), eps)  # FP32: the folded router's input
        w, ids = ops.route(r_in, router_w.cpu(), top_k)
        out.ids = _fail_rows(ids.to(torch.int32), ok, -1)
        out.weights = _fail_rows(w, ok, NAN)
    return out


def attn_tail_router_input_ref(
    partials, xn, attn_out_norm, ffn_norm, n_live, *, eps: float, attn_out_scale: float
) -> torch.Tensor:
    """The twin's router input rms_norm(h32, feed_forward_norm) [n, H] FP32: ops.route's logits
    are this @ router_wᵀ (for checking the kernel's logits)."""
    n = n_live_of(n_live, partials.shape[1])
    h32 = _attn_h32(partial_sum(partials.cpu(), n), xn, attn_out_norm, eps, attn_out_scale)
    return ops.rms_norm(h32, ffn_norm.cpu(), eps)


def moe_tail_ref(
    partials: torch.Tensor,  # [N, R, H] fp32 | bf16 expert-output partials; NaN = not yet written
    h: torch.Tensor,  # [R, H] bf16 residual from the attention tail
    next_norm: torch.Tensor,  # [H] next layer's attention_norm, or the final norm
    n_live,
    fail_flag: torch.Tensor | None = None,
    *,
    eps: float,
    ffn_out_scale: float,
    max_polls: int = 1,
    rearm: torch.Tensor | None = None,
) -> MoeTailOut:
    n = n_live_of(n_live, partials.shape[1])
    acc, ok = readiness(partials.cpu(), n, fail_flag, rearm)
    f = acc.to(torch.bfloat16)
    x = (h[:n].cpu().float() + f.float() * ffn_out_scale).to(torch.bfloat16)
    xn = ops.rms_norm(x, next_norm.cpu(), eps)
    return MoeTailOut(_fail_rows(xn, ok, NAN), _fail_rows(x, ok, NAN))
