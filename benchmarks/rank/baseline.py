"""The round a user would otherwise write: straightforward BF16 torch at the same per-rank
shapes. Reference ops (reference/ops.py: rms_norm, attention with the sink key
and window masks, route) with BF16 GEMMs (F.linear), static KV caches (gpt-fast style: one
[capacity, Hkv, D] tensor per layer, attention over the whole capacity with a position mask),
experts either looped over the distinct ids (host sync per layer) or gathered ([R·K] weight
copies, bmm; no sync, so torch.compile can take it), top-k/top-p sampling and rejection with
host reads. Routing ids come from the same trace table as the engine's (the router still runs).

One round: D draft depths of one row each (token x_m with the target's hidden of m − 1, then
each draft with the draft's own hidden), the target over [x_m, y_1 … y_D], sampling, rejection
(accept y_j with probability min(1, p/q), else resample from max(0, p − q)), settlement
(positions past m + a are overwritten before they are read: attention masks by position).

Layers: 88 BF16 layers are ≈ 80 GB per rank; `layers = layer_pattern(1)` builds 8 (dense 0,
full 1 5 6 7, sliding 2 3 4), times every layer with CUDA events, and scales to 88 as
  T88 = T_round − Σ T_layer(subset) + T_dense + 24 · median T_full + 63 · median T_sliding.

Dimension letters: R rows, H hidden, E experts, K top-k, I expert intermediate, V vocabulary,
C cache capacity, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reference import ops
from reference.config import ModelConfig, SamplingDefaults
from reference.params import FP32, all_specs
from reference.synthetic import _scale_for

EXPERT_MODES = ("loop", "gather")


def baseline_params(cfg: ModelConfig, device, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of all_specs(cfg) (draft prefixed `mtp.`), BF16 (routers FP32), drawn on the
    device with reference/synthetic.py's scales from one seeded generator."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    out = {}
    for name, spec in sorted(all_specs(cfg).items()):
        mean, std = _scale_for(name, spec.shape)
        dtype = torch.float32 if spec.kind == FP32 else torch.bfloat16
        out[name] = torch.empty(spec.shape, dtype=dtype, device=device).normal_(mean, std,
                                                                              generator=g)
    return out


def rope_tables(capacity: int, rotary_dim: int, theta: float, device):
    cos, sin = ops.rope_cos_sin(torch.arange(capacity), rotary_dim, theta)  # [C, rot/2] FP32
    return cos.to(device), sin.to(device)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """ops.rope with gathered tables: x [R, heads, D], cos/sin [R, rot/2]."""
    half = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1).to(x.dtype)


def attention_block(t, xn, w, kc, vc, pos, cos, sin, kpos, window):
    """xn [R, H] → o_proj output [R, H]; writes K/V of the rows at pos into kc/vc [C, Hkv, D]."""
    r, q_size, kv = xn.shape[0], t.q_size, t.kv_size
    qkv = F.linear(xn, w["qkv"])
    q = qkv[:, :q_size].reshape(r, t.num_attention_heads, t.head_dim)
    k = qkv[:, q_size : q_size + kv].reshape(r, t.num_key_value_heads, t.head_dim)
    v = qkv[:, q_size + kv :].reshape(r, t.num_key_value_heads, t.head_dim)
    q = rope(ops.rms_norm(q, w["q_norm"], t.rms_norm_eps), cos[pos], sin[pos])
    k = rope(ops.rms_norm(k, w["k_norm"], t.rms_norm_eps), cos[pos], sin[pos])
    kc.index_copy_(0, pos, k)
    vc.index_copy_(0, pos, v)
    o = ops.attention(q, kc, vc, pos, kpos, window, w["sink"], t.head_dim**-0.5)
    return F.linear(o.reshape(r, q_size), w["o"])


def experts_loop(x, wts, ids, fc, proj):
    """Σ_k wts · expert(x) over the distinct routed experts (one host sync for the id list)."""
    inter = fc.shape[1] // 2
    acc = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        g, u = F.linear(x[rows], fc[e, :inter]), F.linear(x[rows], fc[e, inter:])
        y = F.linear((F.silu(g.float()) * u.float()).to(x.dtype), proj[e])  # [n_e, H]
        acc.index_add_(0, rows, wts[rows, slots, None] * y.float())
    return acc.to(x.dtype)


def experts_gather(x, wts, ids, fc, proj):
    """The same with the R·K expert weights gathered and batched (no host sync)."""
    r, k = ids.shape
    inter = fc.shape[1] // 2
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [R·K, H, 1]
    gu = torch.bmm(fc[flat], xs)[..., 0]  # [R·K, 2I]
    act = (F.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(x.dtype)
    y = torch.bmm(proj[flat], act[:, :, None])[..., 0]  # [R·K, H]
    return (wts.reshape(-1, 1) * y.float()).reshape(r, k, -1).sum(1).to(x.dtype)


def moe_layer(t, x, w, kc, vc, pos, cos, sin, kpos, window, ids, experts):
    """Target layer ≥ 1 (normalized-input residual) → next x [R, H]; ids [R, K] replace the
    router's choice (its weights are kept)."""
    eps = t.rms_norm_eps
    xn = ops.rms_norm(x, w["attention_norm"], eps)
    a = attention_block(t, xn, w, kc, vc, pos, cos, sin, kpos, window)
    h = (xn.float() + ops.rms_norm(a, w["attn_out_norm"], eps).float()
         * t.attn_out_scale).to(x.dtype)
    f_in = ops.rms_norm(h, w["ffn_norm"], eps)
    wts, router_ids = ops.route(f_in, w["router"], t.num_experts_per_tok)
    f = experts(f_in, wts, router_ids if ids is None else ids, w["fc"], w["proj"])
    return (h.float() + f.float() * t.ffn_out_scale).to(x.dtype)


def dense_layer(t, x, w, kc, vc, pos, cos, sin, kpos):
    """Layer 0: sandwich norms, raw residual, dense SwiGLU."""
    eps = t.rms_norm_eps
    a = attention_block(t, ops.rms_norm(x, w["attention_norm"], eps), w, kc, vc, pos, cos, sin,
                        kpos, None)
    h = (x.float() + ops.rms_norm(a, w["attn_out_norm"], eps).float()).to(x.dtype)
    f_in = ops.rms_norm(h, w["ffn_norm"], eps)
    g, u = F.linear(f_in, w["gate"]), F.linear(f_in, w["up"])
    f = F.linear((F.silu(g.float()) * u.float()).to(x.dtype), w["down"])
    return (h.float() + ops.rms_norm(f, w["ffn_out_norm"], eps).float()).to(x.dtype)


def draft_layer(t, d, tok, hprev, w, kc, vc, pos, cos, sin, kpos, experts):
    """One draft depth over R rows → (logits [R, V] FP32, hidden [R, H] bf16)."""
    eps = t.rms_norm_eps
    e = w["embed"][tok]
    eh = torch.cat([ops.rms_norm(e, w["enorm"], eps), ops.rms_norm(hprev, w["hnorm"], eps)], -1)
    x = F.linear(eh, w["eh_proj"])
    xn = ops.rms_norm(x, w["attention_norm"], eps)
    a = attention_block(t, xn, w, kc, vc, pos, cos, sin, kpos, d.sliding_window)
    h = x.float() + ops.rms_norm(a, w["attn_out_norm"], eps).float()  # FP32 residual
    f_in = ops.rms_norm(h, w["ffn_norm"], eps, out_dtype=x.dtype)
    wts, ids = ops.route(f_in, w["router"], d.num_experts_per_tok)
    f = experts(f_in, wts, ids, w["fc"], w["proj"])
    out = h + ops.rms_norm(f, w["ffn_out_norm"], eps).float()
    hidden = ops.rms_norm(out, w["norm"], eps, out_dtype=x.dtype)
    return F.linear(hidden, w["lm_head"]).float(), hidden


def probs(logits: torch.Tensor, s: SamplingDefaults) -> torch.Tensor:
    """[R, V] → temperature / top-k / top-p probabilities [R, V] FP32 (temperature > 0)."""
    v, i = (logits / s.temperature).topk(s.top_k, dim=-1)
    p = torch.softmax(v, dim=-1)
    p = p * ((torch.cumsum(p, -1) - p) < s.top_p)
    return torch.zeros_like(logits).scatter_(1, i, p / p.sum(-1, keepdim=True))


@dataclass
class LayerWeights:
    kind: str  # "dense", "full", "sliding", "draft"
    w: dict[str, torch.Tensor]
    window: int | None
    theta: float
