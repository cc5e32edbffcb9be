"""The runtime target forward: ≤ max_width live rows of consecutive positions in a padded buffer,
built from the ops table (iquestrt/ops.py). Prefill runs the same forward over chunks.

Per layer: qkv_rope — the QKV projection's split-K partials, then qk_rope on them, which writes
the layer's K/V cache in the same launch (the kernels table can fold both into one launch) →
attention → linear_fp8 O (partials) → attention tail → FFN → the next layer's
normalized input.
  * layers ≥ 1: attn_tail (residual base xn, attn_out_norm, feed_forward_norm and the folded FP32
    router: h, f_in, ids, weights) → moe_fp8 → moe_tail (f = bf16(Σ), x = h + f·scale and the
    next layer's attention_norm — or the final norm after the last layer). Each tail also
    quantizes its output for the FP8 GEMM that reads it (f_in for gate/up, xn for the next
    QKV), and so does the attention combine for the O projection: quantize_act's values,
    without a launch of its own.
  * layer 0 (sandwich norms, raw residual): attn_tail with base x and scale 1.0 computes exactly
    h = bf16(x + attn_out_norm(a)) and f_in; the dense SwiGLU uses linear_fp8 for gate/up/down,
    silu_mul_rows for SiLU·up and norm_rows for x = bf16(h + ffn_out_norm(f)) with the next
    layer's attention_norm (kernels/rows.py; layer 0's own attention_norm too).
  * final norm = the last moe_tail; lm_head = linear_bf16_f32 (FP32 logits), or linear_fp8 when
    the checkpoint quantizes it.
Each target layer owns one readiness flag (flags[i]); the engine reads them after the forward.

Dimension letters: R rows (buffer), n live rows, H hidden, F dense intermediate, V vocabulary,
Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import torch

from iquestrt.ops import Live
from iquestrt.weights import AttnWeights, DenseWeights, Fp8Linear, Weights


def padded_positions(start: int, n: int, rows: int, device) -> torch.Tensor:
    pos = torch.full((rows,), -1, dtype=torch.int32, device=device)  # [R]; padding −1
    pos[:n] = torch.arange(start, start + n, dtype=torch.int32, device=device)
    return pos


def padded_tokens(tokens: torch.Tensor, rows: int) -> torch.Tensor:
    """[n] → [R] int64; padding rows hold token 0 (a valid id: gathers stay in bounds)."""
    out = torch.zeros(rows, dtype=torch.int64, device=tokens.device)
    out[: tokens.shape[0]] = tokens
    return out


def attention_block(ops, cfg_t, aw: AttnWeights, xn, pos, live: Live, cache, table,
                    qkv_view=None, xq=None, quantize_o=False):
    """xn [R, H] bf16 → (attention output o [R, Hq·D] bf16, quantize_act(o) made by the
    combine launch when quantize_o and it can, else None); K/V of the live rows written first.
    qkv_view: maps the QKV partials to [S, R, (Hq + 2·Hkv)·D] (a tensor-parallel rank's padded
    block layout, iquestrt/tp/plan.py); None: they are laid out so already. xq: (E4M3 [R, H],
    scales [R, ⌈H/128⌉]) = quantize_act(xn) from the previous MoE tail, or None."""
    heads = dict(num_q_heads=cfg_t.num_attention_heads,
                 num_kv_heads=cfg_t.num_key_value_heads, eps=cfg_t.rms_norm_eps, cache=cache)
    if qkv_view is None:  # the partials [S, R, (Hq + 2·Hkv)·D] and q, k, v, maybe one launch
        _, q, _, _ = ops.qkv_rope(xn, aw.qkv, aw.q_norm, aw.k_norm, pos, table, live, xq=xq,
                                  **heads)
    else:
        parts = qkv_view(ops.linear_fp8_partials(xn, aw.qkv, live, xq=xq)).contiguous()
        q, _, _ = ops.qk_rope(parts, aw.q_norm, aw.k_norm, pos, table, live, **heads)
    scale = cfg_t.head_dim**-0.5
    if quantize_o:
        o, oq = ops.attention_q(q, cache, pos, live, aw.sink_k, scale)  # [R, Hq, D]
    else:
        o, oq = ops.attention(q, cache, pos, live, aw.sink_k, scale), None
    return o.reshape(o.shape[0], cfg_t.q_size), oq


def lm_head(ops, w, hidden, live: Live) -> torch.Tensor:
    if isinstance(w, Fp8Linear):
        return ops.linear_fp8(hidden, w, live, torch.float32)
    return ops.linear_bf16_f32(hidden, w, live, torch.float32)  # [R, V]


class TargetModel:
    def __init__(self, weights: Weights, ops, width: int, prefetcher=None):
        """prefetcher: an iquestrt.prefetch.Prefetcher (a cache hint before sliding layers)."""
        self.w, self.ops, self.width = weights, ops, width
        self.t = weights.cfg.target
        self.prefetcher = prefetcher
        self.layer_trace: list | None = None  # qualification: (layer, xn [n, H] FP32 on the CPU)
        self.route_trace: list | None = None  # qualification: (layer, ids [n, K] on the CPU)

    def forward(self, tokens: torch.Tensor, start: int, caches, flags: torch.Tensor):
        """tokens [n] at positions start … start+n−1 (n ≤ width) → (logits [R, V] FP32,
        hidden [R, H] bf16 after the final norm); rows ≥ n are padding."""
        n, rows, dev = tokens.shape[0], self.width, self.w.device
        if not 1 <= n <= rows:
            raise ValueError(f"TargetModel.forward: {n} rows outside [1, {rows}]")
        return self.forward_rows(padded_tokens(tokens, rows), padded_positions(start, n, rows, dev),
                                 Live.of(n, dev), caches, flags)

    def forward_rows(self, tokens: torch.Tensor, pos: torch.Tensor, live: Live, caches,
                     flags: torch.Tensor):
        """The same on padded device buffers: tokens [R] int64, pos [R] int32 (consecutive for
        the live rows), live rows possibly known only on the device (a device-resident round:
        no host reads, so it can be captured in a CUDA graph)."""
        w, ops, t = self.w, self.ops, self.t
        eps = self.t.rms_norm_eps
        x = w.embed[tokens]  # [R, H] bf16 (padding rows embed token 0; never read)
        _, xn = ops.norm_rows(x, w.layers[0].attn.attention_norm, live, eps)
        xq = None  # quantize_act(xn) when the MoE tail made it (layers ≥ 2)
        last = len(w.layers) - 1
        for layer in w.layers:
            i, aw = layer.index, layer.attn
            if self.layer_trace is not None:  # host-known rows only (prefill, not a round)
                self.layer_trace.append((i, xn[: live.known].float().cpu()))
            if self.prefetcher is not None:
                self.prefetcher.maybe_prefetch(i, xn, live)
            o_parts = self._o_partials(layer, xn, pos, live, caches.target[i], xq)  # [S, R, H]
            next_norm = w.norm if i == last else w.layers[i + 1].attn.attention_norm
            if layer.dense is not None:  # layer 0: raw residual x, scale 1.0
                tail = ops.attn_tail(o_parts, x, aw.attn_out_norm, aw.ffn_norm, live,
                                     flags[i : i + 1], eps=eps, attn_out_scale=1.0)
                x, xn = self._dense(layer.dense, tail.h, tail.f_in, live, next_norm)
                continue
            tail = ops.attn_tail(o_parts, xn, aw.attn_out_norm, aw.ffn_norm, live,
                                 flags[i : i + 1], eps=eps, attn_out_scale=t.attn_out_scale,
                                 router_w=layer.moe.router, top_k=layer.moe.top_k, quantize=True)
            if self.route_trace is not None:  # host-known rows only, like layer_trace
                self.route_trace.append((i, tail.ids[: live.known].long().cpu()))
            out = ops.moe_tail(self._expert_partials(layer, tail, live), tail.h, next_norm, live,
                               flags[i : i + 1], eps=eps, ffn_out_scale=t.ffn_out_scale,
                               quantize=i != last)
            xn, xq = out.xn, (None if out.xq is None else (out.xq, out.sx))
        return self._logits(xn, live), xn

    # --- what a tensor-parallel rank replaces (iquestrt/tp/model.py) ---------------------------
    def _o_partials(self, layer, xn, pos, live: Live, cache, xq=None) -> torch.Tensor:
        """Attention of xn [R, H] (xq: its quantization, or None) → the O projection's partials
        [S, R, H] the tail sums."""
        o, oq = attention_block(self.ops, self.t, layer.attn, xn, pos, live, cache, layer.rope,
                                xq=xq, quantize_o=True)
        return self.ops.linear_fp8_partials(o, layer.attn.o, live, xq=oq)

    def _expert_partials(self, layer, tail, live: Live, out=None):
        """The experts on the attention tail's f_in (its quantization, ids, weights) → the
        partials the MoE tail sums: [1, R, H], one device's expert output (FP32, into `out`
        [R, H] when given)."""
        return self.ops.moe(tail.f_in, tail.weights, tail.ids, layer.moe, live, torch.float32,
                            xq=(tail.fq, tail.sf), out=out)[None]

    def _down(self, act, down: Fp8Linear, live: Live) -> torch.Tensor:
        """Layer 0's down projection → [R, H] bf16."""
        return self.ops.linear_fp8(act, down, live, torch.bfloat16)

    def _logits(self, xn, live: Live) -> torch.Tensor:
        return lm_head(self.ops, self.w.lm_head, xn, live)  # [R, V]

    def _dense(self, dw: DenseWeights, h, f_in, live: Live, next_norm):
        """Layer 0's SwiGLU + ffn_out_norm + raw residual → (x, next layer's xn) [R, H] bf16
        (reference.ops.swiglu with FP8 projections: gate, up, down rounded to bf16, SiLU·up
        rounded to bf16; x = bf16(h + ffn_out_norm(f)))."""
        ops, eps = self.ops, self.t.rms_norm_eps
        g = ops.linear_fp8(f_in, dw.gate, live, torch.bfloat16)  # [R, F]
        u = ops.linear_fp8(f_in, dw.up, live, torch.bfloat16)
        act = ops.silu_mul_rows(g, u, live)
        f = self._down(act, dw.down, live)  # [R, H]
        return ops.norm_rows(h, next_norm, live, eps, b=f, wb=dw.ffn_out_norm,
                             sum_dtype=torch.bfloat16, store_sum=True)
