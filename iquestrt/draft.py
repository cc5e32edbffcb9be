"""The runtime MTP draft: one depth over ≤ max_width live rows in a padded buffer.

e = embed(token); eh = [enorm(e) | hnorm(hprev)] → eh_proj (linear_bf16_f32, bf16 out) → a
layer-0-style block with an FP32 residual: attention (linear_fp8 QKV, qk_rope with the draft's
RoPE base, its ring with the draft window, linear_fp8 O) → h = x + attn_out_norm(a) in FP32 →
f_in = bf16(feed_forward_norm(h)) → its own router on the BF16 f_in (not folded) → moe_fp8 →
out = h + ffn_out_norm(f) → hidden = bf16(norm(out)) → draft lm_head (FP32 logits); hidden is
also the next depth's hprev.
No kernel exists yet for the draft's norms, FP32 residual and BF16 router (the attention tails
round the residual to bf16 before the norm): those run as torch ops of reference/model.py's
semantics, one row at a time (iquestrt/ops.py says why).

Dimension letters: R rows (buffer), n live rows, H hidden, K top-k, V vocabulary.
"""

from __future__ import annotations

import torch

from iquestrt.model import (
    attention_block,
    each_row,
    lm_head,
    padded_positions,
    padded_tokens,
    rms_rows,
)
from iquestrt.ops import Live
from iquestrt.weights import Weights
from reference import ops as ref_ops


class DraftModel:
    def __init__(self, weights: Weights, ops, width: int):
        self.w, self.ops, self.width = weights, ops, width
        self.t = weights.cfg.target

    def forward(self, tokens: torch.Tensor, hprev: torch.Tensor, start: int, cache):
        """tokens [n] at positions start … start+n−1, hprev [n, H] bf16 (target final hidden of
        the previous position, or this draft's previous hidden) → (logits [R, V] FP32,
        hidden [R, H] bf16); rows ≥ n are padding."""
        n, rows, dev = tokens.shape[0], self.width, self.w.device
        if not 1 <= n <= rows:
            raise ValueError(f"DraftModel.forward: {n} rows outside [1, {rows}]")
        hp = torch.zeros(rows, hprev.shape[1], dtype=torch.bfloat16, device=dev)
        hp[:n] = hprev
        return self.forward_rows(padded_tokens(tokens, rows), hp,
                                 padded_positions(start, n, rows, dev), Live.of(n, dev), cache)

    def forward_rows(self, tokens: torch.Tensor, hprev: torch.Tensor, pos: torch.Tensor,
                     live: Live, cache):
        """The same on padded device buffers: tokens [R] int64, hprev [R, H] bf16, pos [R] int32;
        live rows possibly known only on the device (capturable: no host reads)."""
        d, ops, t = self.w.draft, self.ops, self.t
        rows, dev, eps = self.width, self.w.device, t.rms_norm_eps
        n = live.torch_rows(rows)
        h_size = t.hidden_size
        e = d.embed[tokens]  # [R, H]
        eh = torch.empty(rows, 2 * h_size, dtype=torch.bfloat16, device=dev)  # [R, 2H]
        each_row(n, eh, lambda r: torch.cat([
            ref_ops.rms_norm(e[r : r + 1], d.enorm, eps),
            ref_ops.rms_norm(hprev[r : r + 1].to(torch.bfloat16), d.hnorm, eps)], dim=-1))
        x = ops.linear_bf16_f32(eh, d.eh_proj, live, torch.bfloat16)  # [R, H]
        aw = d.attn
        xn = rms_rows(x, aw.attention_norm, n, eps)
        o = attention_block(ops, t, aw, xn, pos, live, cache, d.rope)
        a = ops.linear_fp8(o, aw.o, live, torch.bfloat16)  # [R, H]
        h = torch.empty(rows, h_size, dtype=torch.float32, device=dev)  # FP32 residual
        each_row(n, h, lambda r: x[r : r + 1].float()
                 + ref_ops.rms_norm(a[r : r + 1], aw.attn_out_norm, eps).float())
        f_in = rms_rows(h, aw.ffn_norm, n, eps, torch.bfloat16)
        k = d.moe.top_k
        weights = torch.full((rows, k), float("nan"), dtype=torch.float32, device=dev)
        ids = torch.full((rows, k), -1, dtype=torch.int32, device=dev)
        for r in range(n):
            wr, ir = ref_ops.route(f_in[r : r + 1], d.moe.router, k)
            weights[r : r + 1], ids[r : r + 1] = wr, ir.to(torch.int32)
        f = ops.moe(f_in, weights, ids, d.moe, live, torch.bfloat16)  # [R, H]
        hidden = torch.empty(rows, h_size, dtype=torch.bfloat16, device=dev)
        each_row(n, hidden, lambda r: ref_ops.rms_norm(
            h[r : r + 1] + ref_ops.rms_norm(f[r : r + 1], d.ffn_out_norm, eps).float(),
            d.norm, eps, torch.bfloat16))
        return lm_head(ops, d.lm_head, hidden, live), hidden
