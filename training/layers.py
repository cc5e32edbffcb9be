"""Differentiable, batched building blocks of the training model: the same semantics as
reference/ops.py (FP32 norms, softmax and router; partial NeoX RoPE; sink key with zero value;
windows counting the current token), computed over [B, T] batches instead of rows.

On the GPU the caller wraps the forward in bf16 autocast: matmuls then run in bf16 with FP32
accumulation, everything here that must stay FP32 (norms, softmax, router) upcasts explicitly.

Dimension letters: B batch, T positions, H hidden, Hq/Hkv query/KV heads, G = Hq/Hkv, D head dim,
J extra per-query keys, N tokens (B·T), E experts, K top-k, I expert intermediate, S = N·K slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reference.ops import rope_cos_sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """FP32 result: x · rsqrt(mean(x²) + eps) · weight over the last dim."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial NeoX RoPE on x [B, h, T, D]; cos/sin [T, half] rotate dims [0, 2·half)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def rope_table(positions: torch.Tensor, rotary_dim: int, theta: float, device) -> tuple:
    """(cos, sin) [T, rotary_dim/2] FP32, bit-identical to the reference's angles."""
    cos, sin = rope_cos_sin(positions.cpu(), rotary_dim, theta)
    return cos.to(device), sin.to(device)


def attention(
    q: torch.Tensor,  # [B, Hq, T, D] after q-norm and RoPE
    k: torch.Tensor,  # [B, Hkv, T, D] after k-norm and RoPE
    v: torch.Tensor,  # [B, Hkv, T, D]
    mask: torch.Tensor,  # [T, T] bool: query row may see key column
    sink_k: torch.Tensor | None,  # [Hkv, D], not rotated, value 0
    scale: float,
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """GQA softmax attention over the T shared keys, J optional per-query keys and the sink key.

    extra = (ek [B, Hkv, T, J, D], ev [B, Hkv, T, J, D], emask [T, J] bool): key j of query t
    is ek[:, :, t, j] (the draft's keys written at other depths, model.py). Returns [B, Hq, T, D].
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, t, d)  # [B, Hkv, G, T, D]; head h is group h // G
    scores = (qg @ k.unsqueeze(2).transpose(-1, -2)).float() * scale  # [B, Hkv, G, T, T]
    parts = [scores.masked_fill(~mask, float("-inf"))]
    if extra is not None:
        ek, ev, emask = extra
        es = torch.einsum("bkgtd,bktjd->bkgtj", qg, ek).float() * scale  # [B, Hkv, G, T, J]
        parts.append(es.masked_fill(~emask, float("-inf")))
    if sink_k is not None:
        s = torch.einsum("bkgtd,kd->bkgt", qg.float(), sink_k.float()) * scale
        parts.append(s.unsqueeze(-1))  # [B, Hkv, G, T, 1]
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    out = probs[..., :t].to(v.dtype) @ v.unsqueeze(2)  # [B, Hkv, G, T, D]
    if extra is not None:
        pe = probs[..., t : t + ek.shape[3]].to(ev.dtype)
        out = out + torch.einsum("bkgtj,bktjd->bkgtd", pe, ev)
    return out.reshape(b, hq, t, d)  # the sink's value is zero: it only takes probability


def route(
    x: torch.Tensor, router_w: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP32 router as reference.ops.route: softmax → top-k (stable: lower index first on ties)
    → renormalize. x [N, H] → weights [N, K] FP32, ids [N, K], probs [N, E] (for the aux loss)."""
    with torch.autocast(x.device.type, enabled=False):
        probs = torch.softmax(x.float() @ router_w.float().t(), dim=-1)  # [N, E]
    top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    w = top[:, :top_k]
    return w / w.sum(-1, keepdim=True), ids[:, :top_k], probs


def experts(
    x: torch.Tensor,  # [N, H]
    weights: torch.Tensor,  # [N, K] FP32
    ids: torch.Tensor,  # [N, K]
    fc: torch.Tensor,  # [E, 2I, H] gate rows then up rows
    proj: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:
    """Σ_k weights[n, k] · SwiGLU_{ids[n, k]}(x_n) in k order, FP32 [N, H].

    Grouped GEMM without a per-expert loop: slots are sorted by expert and copied into a zero-
    padded [E, C, H] buffer (C = the busiest expert's slot count, one host sync), two bmm's run
    every expert at once, and gathers bring the results back to slot order. Only permutations
    are used (no colliding scatter-adds), so the forward is deterministic on every device.
    """
    n, k = ids.shape
    e_count, two_i, h = fc.shape
    flat = ids.reshape(-1)  # [S]
    order = torch.argsort(flat, stable=True)  # [S] slots grouped by expert
    counts = torch.bincount(flat, minlength=e_count)  # [E]
    cap = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts  # [E] first sorted slot of each expert
    e_sorted = flat[order]
    rank = torch.arange(flat.numel(), device=x.device) - starts[e_sorted]  # [S] row in group
    pad_idx = e_sorted * cap + rank  # [S] row of the padded buffer
    xs = x[order // k]  # [S, H] input row of each sorted slot
    buf = xs.new_zeros(e_count * cap, h).index_copy(0, pad_idx, xs)  # [E·C, H]
    gu = torch.bmm(buf.view(e_count, cap, h), fc.transpose(1, 2))  # [E, C, 2I]
    g, u = gu[..., : two_i // 2], gu[..., two_i // 2 :]
    a = (F.silu(g.float()) * u.float()).to(gu.dtype)  # [E, C, I]
    y = torch.bmm(a, proj.transpose(1, 2)).reshape(e_count * cap, h)  # [E·C, H]
    inverse = torch.argsort(order)  # [S] sorted position of each slot
    y_slots = y[pad_idx][inverse].reshape(n, k, h).float()  # [N, K, H]
    out = weights[:, 0:1] * y_slots[:, 0]
    for j in range(1, k):
        out = out + weights[:, j : j + 1] * y_slots[:, j]
    return out


def load_balance_loss(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer auxiliary loss E · Σ_e f_e · P_e (1 when routing is uniform):
    f_e = share of the N·K slots sent to expert e (no gradient), P_e = mean router probability."""
    e_count = probs.shape[-1]
    f = torch.bincount(ids.reshape(-1), minlength=e_count).float() / ids.numel()
    return e_count * (f * probs.float().mean(0)).sum()
