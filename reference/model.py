"""The FP32/BF16 reference IQuest-Q1 target and MTP draft, built only from `ops.py`.

Rounding points in BF16 mode (one rounding at the end of each named value): every projection
output, q/k after norm and after RoPE, attention output, each normalized vector, the residual
sums h and out (target), the expert activations. Norms, softmax, router, sink correction and
both lm_heads compute in FP64 and round to FP32 (reference/ops.py: the bits then do not depend on
the CPU's code path). The draft keeps its residual stream in FP32 (`fp32_residual_connection`).
In FP32 mode every value is FP32.

Matched mode ("matched": what the runtime computes, iquestrt/) is bf16-fold plus the runtime's
quantization points, each one rounding, in this order:
  (m1) the input of every block-FP8 projection — qkv_proj, o_proj, layer-0 gate/up/down, a
       quantized lm_head — is quantized per row per 128 columns (ops.quantize_act → dequant_act)
       and the GEMM is FP32 on the dequantized E4M3 weight, rounded once to its output dtype;
  (m2) q/k-norm: the sum of squares of a head in FP64, rounded once to FP32, then
       x · (1/sqrt(mean + eps)) · w (kernels/qk_rope.py; an FP32 sum would depend on order);
  (m3) experts: input quantized as (m1); gate and up FP32 GEMMs (no rounding), SiLU·up in FP32
       as g / (1 + exp(−g)) · u, that intermediate quantized per slot per 128 columns (m1's
       quantizer), down FP32, the K expert outputs summed in k order with the FP32 router
       weights, rounded once (reference/twins/moe.py moe_fp8_ref; kernels/moe.py);
  (m4) attention reads exactly the keys each query row may see (no masked-out keys in the sums).
Weights of block kind stay FP32 (E4M3 · scale is not on the BF16 grid). Every row is computed
on its own (a scratch cache carries the rows before it), as the runtime's batch-invariant kernels
do: torch's CPU GEMMs round differently for different row counts, so only row-at-a-time
evaluation gives a definition whose bits do not depend on how a round batches its rows.

Dimension letters: R rows, L cached keys, H hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference import ops
from reference.config import FULL, ModelConfig
from reference.params import BLOCK, DRAFT_PREFIX, all_specs
from reference.twins.moe import silu_mul


@dataclass(frozen=True)
class Precision:
    """Reference precision modes.

    fp32      — every value FP32.
    bf16      — BF16 activations (rounding points in the module docstring); the router reads the
                BF16-rounded normalized expert input, upcast to FP32.
    bf16-fold — as bf16, but the target's routers (layers ≥ 1) read the un-rounded FP32
                expression rms_norm(xn + attn_out_norm(a)·scale) — what the runtime's router
                folded into the attention tail computes. The draft keeps its BF16 router.
    matched   — as bf16-fold, plus the runtime's FP8 activation quantization, computed one row
                at a time (module docstring, m1–m4).
    """

    name: str
    act_dtype: torch.dtype
    fold_router: bool = False
    matched: bool = False

    @classmethod
    def of(cls, name: str) -> Precision:
        table = {
            "fp32": (torch.float32, False, False),
            "bf16": (torch.bfloat16, False, False),
            "bf16-fold": (torch.bfloat16, True, False),
            "matched": (torch.bfloat16, True, True),
        }
        if name not in table:
            raise ValueError(f"precision: unknown mode {name!r}; choose one of {sorted(table)}")
        return cls(name, *table[name])


class KVCache:
    """Plain growing per-layer K/V with explicit positions (no ring: windows are masks).

    `start` is the position of the first cached row (0 for the target; 1 for the draft, whose
    position 0 never has an entry because it has no previous hidden state). Rows are always
    contiguous positions start … start+length−1; rollback truncates.
    """

    def __init__(self, n_layers: int, start: int = 0):
        self.start = start
        self.k: list[torch.Tensor | None] = [None] * n_layers  # [L, Hkv, D]
        self.v: list[torch.Tensor | None] = [None] * n_layers

    @property
    def length(self) -> int:
        k = self.k[0]
        return 0 if k is None else k.shape[0]

    @property
    def next_position(self) -> int:
        return self.start + self.length

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k if old_k is None else torch.cat([old_k, k])
        self.v[layer] = v if old_v is None else torch.cat([old_v, v])
        return self.k[layer], self.v[layer]

    def positions(self, layer: int) -> torch.Tensor:
        k = self.k[layer]
        n = 0 if k is None else k.shape[0]
        return torch.arange(self.start, self.start + n)

    def truncate(self, next_position: int) -> None:
        """Roll back: keep only rows at positions < next_position."""
        keep = next_position - self.start
        if not 0 <= keep <= self.length:
            raise ValueError(
                f"KVCache.truncate: position {next_position} outside "
                f"[{self.start}, {self.next_position}]"
            )
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i] = self.k[i][:keep]
                self.v[i] = self.v[i][:keep]

    def clone(self) -> KVCache:
        c = KVCache(len(self.k), self.start)
        c.k = [None if t is None else t.clone() for t in self.k]
        c.v = [None if t is None else t.clone() for t in self.v]
        return c


@dataclass
class Output:
    logits: torch.Tensor  # [R, V] FP32
    hidden: torch.Tensor  # [R, H] after the final norm (feeds the draft's hnorm)


class ReferenceModel:
    """Target + draft over a flat parameter dict of floating tensors (block weights dequantized)."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], precision: str = "fp32"):
        self.cfg = cfg
        self.precision = Precision.of(precision)
        self.layer_trace: list | None = None  # set to [] to collect (layer, xn [R, H] FP32)
        self.route_trace: list | None = None  # [] to collect (layer, router in [R, H], ids [R, K])
        specs = all_specs(cfg)
        missing = sorted(set(specs) - set(params))
        if missing:
            raise ValueError(f"ReferenceModel: missing parameters {missing[:5]}")
        act, matched = self.precision.act_dtype, self.precision.matched
        self.p: dict[str, torch.Tensor] = {}
        self.block = {name for name, spec in specs.items() if spec.kind == BLOCK}
        for name, spec in specs.items():
            t = params[name]
            if t.dtype == torch.float8_e4m3fn:
                raise ValueError(f"ReferenceModel: {name} is E4M3; dequantize it first")
            fp32 = spec.kind == "fp32" or (matched and spec.kind == BLOCK)
            self.p[name] = t.float() if fp32 else t.to(act)

    # --- matched mode (module docstring m1–m4) ------------------------------------------------
    def _lin(self, x: torch.Tensor, name: str, out_dtype=None) -> torch.Tensor:
        """ops.linear, with (m1) the activation quantization of block-FP8 weights when matched."""
        if self.precision.matched and name in self.block:
            x = ops.dequant_act(*ops.quantize_act(x))
            return ops.linear(x, self.p[name], out_dtype=out_dtype or self.precision.act_dtype)
        return ops.linear(x, self.p[name], out_dtype=out_dtype)

    def _head_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        eps = self.cfg.target.rms_norm_eps
        if not self.precision.matched:
            return ops.rms_norm(x, self.p[name], eps)
        xf = x.float()  # (m2)
        mean = (xf.double() ** 2).sum(-1, keepdim=True).float() / x.shape[-1]
        return (xf * (1.0 / torch.sqrt(mean + eps)) * self.p[name].float()).to(x.dtype)

    def _swiglu(self, pre: str, x: torch.Tensor) -> torch.Tensor:
        if not self.precision.matched:
            p = self.p
            return ops.swiglu(x, p[pre + "mlp.gate_proj.weight"], p[pre + "mlp.up_proj.weight"],
                              p[pre + "mlp.down_proj.weight"])
        g = self._lin(x, pre + "mlp.gate_proj.weight")  # ops.swiglu's roundings, (m1) inputs
        u = self._lin(x, pre + "mlp.up_proj.weight")
        return self._lin(ops.silu_mul(g, u, x.dtype), pre + "mlp.down_proj.weight")

    def _moe_matched(self, pre: str, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor):
        """(m3) for one row: x [1, H], w [1, K] FP32, ids [1, K] → [1, H]."""
        fc, proj = self.p[pre + "mlp.experts.fc"], self.p[pre + "mlp.experts.proj"]
        inter, k = fc.shape[1] // 2, ids.shape[1]
        xd = ops.dequant_act(*ops.quantize_act(x))  # [1, H]
        a = torch.zeros(k, inter)  # [K, I] FP32 SiLU·up per slot
        for j in range(k):
            e = int(ids[0, j])
            g = ops.linear(xd, fc[e, :inter], out_dtype=torch.float32)  # [1, I]
            u = ops.linear(xd, fc[e, inter:], out_dtype=torch.float32)
            a[j : j + 1] = silu_mul(g, u)
        ad = ops.dequant_act(*ops.quantize_act(a))  # [K, I]
        acc = torch.zeros(1, x.shape[1])
        for j in range(k):
            y = ops.linear(ad[j : j + 1].clone(), proj[int(ids[0, j])], out_dtype=torch.float32)
            acc = acc + w[:, j : j + 1] * y
        return acc.to(x.dtype)

    def _one_row_at_a_time(self, fn, cache: KVCache | None, n_layers: int, positions, *rows):
        """Matched mode: fn over each row in turn. cache None: the rows see only each other, i.e.
        a scratch cache starting at the first row's position."""
        if cache is None:
            cache = KVCache(n_layers, start=int(positions[0]))
        outs = [fn(*(t[r : r + 1] for t in rows), positions[r : r + 1], cache)
                for r in range(positions.shape[0])]
        return Output(torch.cat([o.logits for o in outs]), torch.cat([o.hidden for o in outs]))

    # --- shared blocks -------------------------------------------------------------------
    def _attn(
        self,
        pre: str,
        xn: torch.Tensor,  # [R, H] normalized input
        positions: torch.Tensor,  # [R]
        cache: KVCache | None,
        layer: int,
        window: int | None,
        theta: float,
        rope_offset: int = 0,  # the draft's RoPE position is its row's position + this
    ) -> torch.Tensor:
        t = self.cfg.target
        p, act = self.p, self.precision.act_dtype
        r = xn.shape[0]
        qkv = self._lin(xn, pre + "self_attn.qkv_proj.weight")  # [R, q + 2kv]
        q = qkv[:, : t.q_size].reshape(r, t.num_attention_heads, t.head_dim)
        k = qkv[:, t.q_size : t.q_size + t.kv_size].reshape(r, t.num_key_value_heads, t.head_dim)
        v = qkv[:, t.q_size + t.kv_size :].reshape(r, t.num_key_value_heads, t.head_dim)
        if t.qk_norm:
            q = self._head_norm(q, pre + "self_attn.q_norm.weight")
            k = self._head_norm(k, pre + "self_attn.k_norm.weight")
        q = ops.rope(q, positions + rope_offset, t.rotary_dim, theta)
        k = ops.rope(k, positions + rope_offset, t.rotary_dim, theta)
        if cache is None:
            keys, values, k_pos = k, v, positions
        else:
            expected = cache.start + len(cache.positions(layer))
            if positions[0].item() != expected:
                raise ValueError(
                    f"reference: rows start at position {positions[0].item()}, "
                    f"layer {layer} cache expects {expected}"
                )
            keys, values = cache.append(layer, k, v)
            k_pos = cache.positions(layer)
            if self.precision.matched:  # (m4): one row; only the keys it may see
                seen = ops.visible(positions, k_pos, window)[0]
                keys, values, k_pos = keys[seen], values[seen], k_pos[seen]
        sink = p[pre + "self_attn.sink_k"] if t.attention_sink else None
        o = ops.attention(
            q, keys, values, positions, k_pos, window, sink, t.head_dim**-0.5, out_dtype=act
        )
        return self._lin(o.reshape(r, t.q_size), pre + "self_attn.o_proj.weight")

    def _moe(
        self, pre: str, x: torch.Tensor, top_k: int, router_in: torch.Tensor | None = None
    ) -> torch.Tensor:
        """router_in: the router's input when it differs from the expert input x (folded)."""
        p = self.p
        src = x if router_in is None else router_in
        w, ids = ops.route(src, p[pre + "mlp.router.weight"], top_k)
        if self.route_trace is not None:  # qualification: routing flips (gate 1)
            self.route_trace.append((int(pre.split(".")[2]), src.float(), ids))
        if self.precision.matched:
            return self._moe_matched(pre, x, w, ids)
        return ops.moe(x, w, ids, p[pre + "mlp.experts.fc"], p[pre + "mlp.experts.proj"])

    # --- target --------------------------------------------------------------------------
    def target(
        self,
        tokens: torch.Tensor,  # [R] int
        positions: torch.Tensor,  # [R] consecutive
        cache: KVCache | None = None,  # None: no cache, the rows attend only to themselves
    ) -> Output:
        if self.precision.matched:
            n = self.cfg.target.num_hidden_layers
            return self._one_row_at_a_time(self._target, cache, n, positions, tokens)
        return self._target(tokens, positions, cache)

    def _target(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None):
        t, p = self.cfg.target, self.p
        eps, act = t.rms_norm_eps, self.precision.act_dtype
        x = p["model.embed_tokens.weight"][tokens]  # [R, H]
        for i, kind in enumerate(t.layer_types):
            pre = f"model.layers.{i}."
            full = kind == FULL
            window = None if full else t.sliding_window
            theta = t.rope_theta if full else t.swa_rope_theta
            xn = ops.rms_norm(x, p[pre + "attention_norm.weight"], eps)
            if self.layer_trace is not None:  # qualification: each layer's attention input
                self.layer_trace.append((i, xn.float()))
            a = self._attn(pre, xn, positions, cache, i, window, theta)
            an = ops.rms_norm(a, p[pre + "attn_out_norm.weight"], eps)
            if i == 0:  # sandwich norms, raw residual
                h = (x.float() + an.float()).to(act)
                f_in = ops.rms_norm(h, p[pre + "feed_forward_norm.weight"], eps)
                f = self._swiglu(pre, f_in)
                fn = ops.rms_norm(f, p[pre + "ffn_out_norm.weight"], eps)
                x = (h.float() + fn.float()).to(act)
            else:  # normalized-input residual, scaled, no FFN output norm
                h32 = xn.float() + an.float() * t.attn_out_scale
                h = h32.to(act)
                f_in = ops.rms_norm(h, p[pre + "feed_forward_norm.weight"], eps)
                r_in = None
                if self.precision.fold_router:
                    r_in = ops.rms_norm(h32, p[pre + "feed_forward_norm.weight"], eps)
                f = self._moe(pre, f_in, t.num_experts_per_tok, r_in)
                x = (h.float() + f.float() * t.ffn_out_scale).to(act)
        hidden = ops.rms_norm(x, p["model.norm.weight"], eps)
        logits = self._lin(hidden, "lm_head.weight", out_dtype=torch.float32)
        return Output(logits, hidden)

    # --- draft ---------------------------------------------------------------------------
    def draft(
        self,
        tokens: torch.Tensor,  # [R] the token at each row's position
        hprev: torch.Tensor,  # [R, H] final-normed hidden of the previous position
        positions: torch.Tensor,  # [R] consecutive
        cache: KVCache | None = None,
    ) -> Output:
        """One draft depth over R rows. hprev is the target's final hidden at depth 0 and the
        draft's own previous output at later depths; the output hidden serves both."""
        if self.precision.matched:
            return self._one_row_at_a_time(self._draft, cache, 1, positions, tokens, hprev)
        return self._draft(tokens, hprev, positions, cache)

    def _draft(self, tokens, hprev, positions, cache: KVCache | None) -> Output:
        t, d, p = self.cfg.target, self.cfg.draft, self.p
        eps, act = t.rms_norm_eps, self.precision.act_dtype
        pre = DRAFT_PREFIX
        e = p[pre + "embed_tokens.weight"][tokens]  # [R, H]
        eh = torch.cat(
            [
                ops.rms_norm(e, p[pre + "enorm.weight"], eps),
                ops.rms_norm(hprev.to(act), p[pre + "hnorm.weight"], eps),
            ],
            dim=-1,
        )  # [R, 2H], embedding half first
        x = ops.linear(eh, p[pre + "eh_proj.weight"])  # [R, H]
        lp = pre + "layer."
        xn = ops.rms_norm(x, p[lp + "attention_norm.weight"], eps)
        a = self._attn(lp, xn, positions, cache, 0, d.sliding_window, d.swa_rope_theta,
                       d.draft_position_offset)
        an = ops.rms_norm(a, p[lp + "attn_out_norm.weight"], eps)
        h = x.float() + an.float()  # FP32 residual
        f_in = ops.rms_norm(h, p[lp + "feed_forward_norm.weight"], eps, out_dtype=act)
        f = self._moe(lp, f_in, d.num_experts_per_tok)
        out = h + ops.rms_norm(f, p[lp + "ffn_out_norm.weight"], eps).float()
        hidden = ops.rms_norm(out, p[pre + "norm.weight"], eps, out_dtype=act)
        logits = ops.linear(hidden, p[pre + "lm_head.weight"], out_dtype=torch.float32)
        return Output(logits, hidden)

    def new_target_cache(self) -> KVCache:
        return KVCache(self.cfg.target.num_hidden_layers, start=0)

    def new_draft_cache(self) -> KVCache:
        return KVCache(1, start=1)
