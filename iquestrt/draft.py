"""The runtime MTP draft: one depth over ≤ max_width live rows in a padded buffer.

e = embed(token); eh = [enorm(e) | hnorm(hprev)] → eh_proj (linear_bf16_f32, bf16 out) → a
layer-0-style block with an FP32 residual: attention (linear_fp8 QKV, qk_rope with the draft's
RoPE base, its ring with the draft window, linear_fp8 O) → h = x + attn_out_norm(a) in FP32 →
f_in = bf16(feed_forward_norm(h)) → its own router on the BF16 f_in (not folded) → moe_fp8 →
out = h + ffn_out_norm(f) → hidden = bf16(norm(out)) → draft lm_head (FP32 logits); hidden is
also the next depth's hprev.
The norms, the FP32 residual and the BF16 router run as row kernels (kernels/rows.py: the
attention tails round the residual to bf16, the draft's does not).

Dimension letters: R rows (buffer), n live rows, H hidden, K top-k, V vocabulary.
"""

from __future__ import annotations

import torch

from iquestrt.model import (
    attention_block,
    lm_head,
    padded_positions,
    padded_tokens,
)
from iquestrt.ops import EntryNorms, EntrySource, Live
from iquestrt.weights import Weights


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
        h_size = t.hidden_size
        e = d.embed[tokens]  # [R, H]
        eh = torch.empty(rows, 2 * h_size, dtype=torch.bfloat16, device=dev)  # [R, 2H]
        ops.norm_rows(e, d.enorm, live, eps, y_out=eh[:, :h_size])
        ops.norm_rows(hprev, d.hnorm, live, eps, y_out=eh[:, h_size:])
        return self._body(eh, pos, live, cache)

    def forward_entry(self, tokens_src: torch.Tensor, tok_base, tok_max: int,
                      hid_src: torch.Tensor, hid_base, pos_base, live: Live, cache,
                      fused: bool = False):
        """forward_rows with its operands built by one entry launch (kernels/draft_entry.py):
        row r < n takes token tokens_src[clamp(tok_base + r, 0, tok_max)] [P] (id clamped to
        [0, V − 1]) and hprev hid_src[clamp(hid_base + r, 0, S − 1)] [S, H] at position
        pos_base + r. The bases are device [1] tensors or host ints (capturable: no host
        reads). fused: the operand is built inside the eh_proj GEMM instead (kernels/eh_proj.py,
        the same bits; a later depth's one row). → (logits [R, V] FP32, hidden [R, H] bf16,
        pos [R] int32, padding −1)."""
        d, t = self.w.draft, self.t
        rows, dev = self.width, self.w.device
        pos = torch.empty(rows, dtype=torch.int32, device=dev)  # [R]
        src = EntrySource(tokens_src, tok_base, tok_max, hid_src, hid_base, pos_base)
        norms = EntryNorms(d.embed, d.enorm, d.hnorm, t.rms_norm_eps)
        if fused:
            x, _ = self.ops.eh_proj(src, live, norms, d.eh_proj, pos)  # [R, H]
        else:
            eh = torch.empty(rows, 2 * t.hidden_size, dtype=torch.bfloat16, device=dev)  # [R, 2H]
            self.ops.draft_entry(src, live, norms, eh, pos)
            x = self.ops.linear_bf16_f32(eh, d.eh_proj, live, torch.bfloat16)  # [R, H]
        logits, hidden = self._layer(x, pos, live, cache)
        return logits, hidden, pos

    def _body(self, eh: torch.Tensor, pos: torch.Tensor, live: Live, cache):
        """eh [R, 2H] bf16 (live rows) → (logits [R, V] FP32, hidden [R, H] bf16)."""
        x = self.ops.linear_bf16_f32(eh, self.w.draft.eh_proj, live, torch.bfloat16)  # [R, H]
        return self._layer(x, pos, live, cache)

    def _layer(self, x: torch.Tensor, pos: torch.Tensor, live: Live, cache):
        """x [R, H] bf16 = eh_proj's output → (logits [R, V] FP32, hidden [R, H] bf16)."""
        d, ops, t = self.w.draft, self.ops, self.t
        eps = t.rms_norm_eps
        aw = d.attn
        _, xn = ops.norm_rows(x, aw.attention_norm, live, eps)
        o, _ = attention_block(ops, t, aw, xn, pos, live, cache, d.rope)
        a = ops.linear_fp8(o, aw.o, live, torch.bfloat16)  # [R, H]
        # FP32 residual h = x + attn_out_norm(a); f_in = bf16(ffn_norm(h))
        h, f_in = ops.norm_rows(x, aw.ffn_norm, live, eps, b=a, wb=aw.attn_out_norm,
                                store_sum=True)
        weights, ids = ops.route_rows(f_in, d.moe.router, d.moe.top_k, live)  # [R, K]
        f = ops.moe(f_in, weights, ids, d.moe, live, torch.bfloat16)  # [R, H]
        _, hidden = ops.norm_rows(h, d.norm, live, eps, b=f, wb=d.ffn_out_norm)
        return lm_head(ops, d.lm_head, hidden, live), hidden
