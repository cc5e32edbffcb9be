"""The trainable IQuest-Q1 target and recursive MTP draft over [B, T] batches.

Parameters are registered in a module tree whose state-dict keys are exactly the names of
reference/params.py (draft under `mtp.`), so `export_params()` feeds reference/checkpoint.py's
writer directly. Semantics follow reference/model.py in FP32: dense sandwich layer 0, normalized-
input residual with attn_out_scale / ffn_out_scale on layers ≥ 1, qk-norm before partial RoPE,
sink keys, windows counting the current token, FP32 softmax-top-k router with renormalization.

Draft training (teacher-forced recursion, D = num_draft_slots depths). Depth j's row at
position p reads the token x_p and hprev = depth j−1's output at p−1 (depth 0: the target's final
hidden at p−1) and predicts x_{p+1}; it exists for p ≥ j+1 (the draft cache starts at
position 1). Its keys reproduce what inference's draft cache holds when depth j runs at p:
rows at distance d ≥ j were written by depth 0 (catch-up rows up to m = p−j), the d < j nearer
rows by depths j−d of the same round (each depth appends its KV) — see
reference/speculative.py. Inference may also keep accepted deeper rows beyond distance j; the
training keys approximate those by depth-0 rows.

Dimension letters: B batch, T positions, H hidden, V vocabulary, Dh head dim, J extra keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from reference.config import FULL, ModelConfig
from reference.ops import visible
from reference.params import DRAFT_PREFIX, all_specs
from training import layers as L


@dataclass
class TargetOut:
    logits: torch.Tensor  # [B, T, V] FP32
    hidden: torch.Tensor  # [B, T, H] after the final norm (the draft's depth-0 hprev)
    aux: torch.Tensor  # scalar: mean load-balancing loss over the MoE layers


@dataclass
class DraftOut:
    logits: list[torch.Tensor]  # per depth j: [B, T, V] FP32; rows p < j+1 are not defined
    aux: torch.Tensor  # scalar: mean load-balancing loss over depths


def init_params(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Training initialization (not reference/synthetic.py's test weights).

    Matrices N(0, 1/fan_in); down projections (dense down_proj, experts.proj) additionally
    scaled by 1/sqrt(2·layers) (GPT-2); embeddings N(0, 1); sink keys N(0, 1) (sink logit std
    ≈ 1 after qk-norm); routers N(0, 0.02²) (near-uniform routing at first); lm_heads
    N(0, 0.25/H). Norm weights 1, except the branch-output norms attn_out_norm / ffn_out_norm at
    0.1: each layer adds a unit-rms branch to a unit-rms normalized input, so with weight 1 the
    token's own signal halves in power per layer and after 8 layers the target did not learn at
    all (tiny, 40 steps: loss stayed at ln V; with 0.1 it fell to 0.45 on a bigram corpus).
    """
    gen = torch.Generator().manual_seed(seed)
    down = (2 * cfg.target.num_hidden_layers) ** -0.5
    out = {}
    for name, spec in sorted(all_specs(cfg).items()):
        fan_in = spec.shape[-1]
        if name.endswith(("attn_out_norm.weight", "ffn_out_norm.weight")):
            out[name] = torch.full(spec.shape, 0.1)
            continue
        if name.endswith("norm.weight"):
            out[name] = torch.ones(spec.shape)
            continue
        if name.endswith(("embed_tokens.weight", "sink_k")):
            std = 1.0
        elif name.endswith("router.weight"):
            std = 0.02
        elif name.endswith("lm_head.weight"):
            std = 0.5 / fan_in**0.5
        elif name.endswith(("down_proj.weight", "experts.proj")):
            std = down / fan_in**0.5
        else:
            std = 1.0 / fan_in**0.5
        out[name] = torch.randn(spec.shape, generator=gen) * std
    return out


class TrainModel(nn.Module):
    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        specs = all_specs(cfg)
        missing, extra = sorted(set(specs) - set(params)), sorted(set(params) - set(specs))
        if missing or extra:
            raise ValueError(f"TrainModel: missing parameters {missing[:3]}, unknown {extra[:3]}")
        for name, spec in specs.items():
            if tuple(params[name].shape) != spec.shape:
                raise ValueError(
                    f"TrainModel: {name} has shape {tuple(params[name].shape)}, "
                    f"expected {spec.shape}"
                )
            *path, leaf = name.split(".")
            mod = self
            for part in path:
                children = dict(mod.named_children())
                if part not in children:
                    mod.add_module(part, nn.Module())  # raises if `part` shadows an attribute
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(params[name].detach().float().clone()))

    def export_params(self) -> dict[str, torch.Tensor]:
        """FP32 CPU tensors under the canonical names (reference/checkpoint.py's writer input)."""
        return {n: p.detach().float().cpu().clone() for n, p in self.named_parameters()}

    # --- shared pieces ------------------------------------------------------------------
    def _qkv(self, p, pre, xn, cos, sin):
        """xn [B, T, H] → q [B, Hq, T, D], k, v [B, Hkv, T, D] (q/k normed, then rotated)."""
        t = self.cfg.target
        b, n, _ = xn.shape
        qkv = xn @ p[pre + "self_attn.qkv_proj.weight"].t()  # [B, T, q + 2kv]
        q = qkv[..., : t.q_size].reshape(b, n, t.num_attention_heads, t.head_dim)
        k = qkv[..., t.q_size : t.q_size + t.kv_size].reshape(b, n, -1, t.head_dim)
        v = qkv[..., t.q_size + t.kv_size :].reshape(b, n, -1, t.head_dim)
        if t.qk_norm:
            q = L.rms_norm(q, p[pre + "self_attn.q_norm.weight"], t.rms_norm_eps)
            k = L.rms_norm(k, p[pre + "self_attn.k_norm.weight"], t.rms_norm_eps)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        return L.rope(q, cos, sin), L.rope(k, cos, sin), v

    def _attn_out(self, p, pre, q, k, v, mask, extra=None) -> torch.Tensor:
        t = self.cfg.target
        sink = p[pre + "self_attn.sink_k"] if t.attention_sink else None
        o = L.attention(q, k, v, mask, sink, t.head_dim**-0.5, extra)  # [B, Hq, T, D]
        b, _, n, _ = o.shape
        return o.transpose(1, 2).reshape(b, n, t.q_size) @ p[pre + "self_attn.o_proj.weight"].t()

    def _moe(self, p, pre, x, top_k):
        """x [B, T, H] → (FP32 [B, T, H], aux loss)."""
        b, n, h = x.shape
        flat = x.reshape(b * n, h)
        w, ids, probs = L.route(flat, p[pre + "mlp.router.weight"], top_k)
        y = L.experts(flat, w, ids, p[pre + "mlp.experts.fc"], p[pre + "mlp.experts.proj"])
        return y.reshape(b, n, h), L.load_balance_loss(probs, ids)

    def _swiglu(self, p, pre, x):
        g = x @ p[pre + "mlp.gate_proj.weight"].t()
        u = x @ p[pre + "mlp.up_proj.weight"].t()
        act = torch.nn.functional.silu(g.float()) * u.float()
        return act @ p[pre + "mlp.down_proj.weight"].t()

    # --- target --------------------------------------------------------------------------
    def target(self, tokens: torch.Tensor) -> TargetOut:
        """tokens [B, T] at positions 0 … T−1."""
        t, p = self.cfg.target, dict(self.named_parameters())
        eps, dev = t.rms_norm_eps, tokens.device
        pos = torch.arange(tokens.shape[1])
        ropes = {th: L.rope_table(pos, t.rotary_dim, th, dev)
                 for th in (t.rope_theta, t.swa_rope_theta)}
        masks = {FULL: visible(pos, pos, None).to(dev),
                 "sliding": visible(pos, pos, t.sliding_window).to(dev)}  # [T, T]
        x = p["model.embed_tokens.weight"][tokens].float()  # [B, T, H]
        aux = []
        for i, kind in enumerate(t.layer_types):
            pre = f"model.layers.{i}."
            cos, sin = ropes[t.rope_theta if kind == FULL else t.swa_rope_theta]
            xn = L.rms_norm(x, p[pre + "attention_norm.weight"], eps)
            q, k, v = self._qkv(p, pre, xn, cos, sin)
            a = self._attn_out(p, pre, q, k, v, masks[FULL if kind == FULL else "sliding"])
            an = L.rms_norm(a, p[pre + "attn_out_norm.weight"], eps)
            if i == 0:  # sandwich norms, raw residual
                h = x + an
                f = self._swiglu(p, pre, L.rms_norm(h, p[pre + "feed_forward_norm.weight"], eps))
                x = h + L.rms_norm(f, p[pre + "ffn_out_norm.weight"], eps)
            else:  # normalized-input residual, scaled, no FFN output norm
                h = xn + an * t.attn_out_scale
                f_in = L.rms_norm(h, p[pre + "feed_forward_norm.weight"], eps)
                f, a_loss = self._moe(p, pre, f_in, t.num_experts_per_tok)
                aux.append(a_loss)
                x = h + f * t.ffn_out_scale
        hidden = L.rms_norm(x, p["model.norm.weight"], eps)
        logits = (hidden @ p["lm_head.weight"].t()).float()
        return TargetOut(logits, hidden, torch.stack(aux).mean())

    # --- draft ---------------------------------------------------------------------------
    def draft(self, tokens: torch.Tensor, target_hidden: torch.Tensor, depths: int) -> DraftOut:
        """tokens [B, T]; target_hidden [B, T, H] (TargetOut.hidden); depths ≤ T − 1."""
        t, d, p = self.cfg.target, self.cfg.draft, dict(self.named_parameters())
        eps, dev, n = t.rms_norm_eps, tokens.device, tokens.shape[1]
        if not 1 <= depths < n:
            raise ValueError(f"draft: depths must be in [1, T−1 = {n - 1}], got {depths}")
        pre, lp = DRAFT_PREFIX, DRAFT_PREFIX + "layer."
        pos = torch.arange(n)
        # RoPE at the row's position + the draft's convention (the shipped mini: + 0)
        cos, sin = L.rope_table(pos + d.draft_position_offset, t.rotary_dim, d.swa_rope_theta, dev)
        dist = (pos[:, None] - pos[None, :]).to(dev)  # [T, T] query minus key position
        in_window = visible(pos, pos, d.sliding_window).to(dev)
        e = L.rms_norm(p[pre + "embed_tokens.weight"][tokens], p[pre + "enorm.weight"], eps)
        hprev = _shift(target_hidden)
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per depth: k, v [B, Hkv, T, D]
        logits, aux = [], []
        for j in range(depths):
            hn = L.rms_norm(hprev, p[pre + "hnorm.weight"], eps)
            x = torch.cat([e, hn], dim=-1) @ p[pre + "eh_proj.weight"].t()  # [B, T, H]
            x = x.float()  # fp32_residual_connection
            xn = L.rms_norm(x, p[lp + "attention_norm.weight"], eps)
            q, k, v = self._qkv(p, lp, xn, cos, sin)
            kv.append((k, v))
            # depth-0 keys at distance ≥ j, never the draft's non-row at position 0 (except for
            # depth 0's own undefined row 0, which must see something)
            mask = in_window & (dist >= j) & ((pos[None, :].to(dev) >= 1) | (dist == 0))
            extra = _diagonal_keys(kv, j, d.sliding_window, dev) if j else None
            k0, v0 = kv[0]
            a = self._attn_out(p, lp, q, k0, v0, mask, extra)
            h = x + L.rms_norm(a, p[lp + "attn_out_norm.weight"], eps)
            f_in = L.rms_norm(h, p[lp + "feed_forward_norm.weight"], eps)
            f, a_loss = self._moe(p, lp, f_in, d.num_experts_per_tok)
            aux.append(a_loss)
            out = h + L.rms_norm(f, p[lp + "ffn_out_norm.weight"], eps)
            hidden = L.rms_norm(out, p[pre + "norm.weight"], eps)
            logits.append((hidden @ p[pre + "lm_head.weight"].t()).float())
            hprev = _shift(hidden)
        return DraftOut(logits, torch.stack(aux).mean())


def _shift(h: torch.Tensor) -> torch.Tensor:
    """[B, T, H] → row p holds h[:, p−1]; row 0 is zero (no previous position)."""
    return torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)


def _diagonal_keys(kv, j: int, window: int, dev):
    """Keys of depth j's query at p written by this round's depths j−d (d = 0 … j−1) at p−d.

    Returns ek, ev [B, Hkv, T, J=j, D] and emask [T, J] (p−d ≥ 0 and inside the window)."""
    ks, vs = [], []
    for dd in range(j):
        k, v = kv[j - dd]
        ks.append(torch.nn.functional.pad(k, (0, 0, dd, 0))[:, :, : k.shape[2]])  # row p: p−dd
        vs.append(torch.nn.functional.pad(v, (0, 0, dd, 0))[:, :, : v.shape[2]])
    n = kv[0][0].shape[2]
    dist = torch.arange(j)
    emask = (torch.arange(n)[:, None] >= dist[None, :]) & (dist[None, :] < window)
    return torch.stack(ks, dim=3), torch.stack(vs, dim=3), emask.to(dev)
