"""The "twins" implementation of iquestrt/ops.py's op table: the reference twins of kernels/,
one live row at a time, written into padded outputs whose padding rows hold NaN (ids −1), so a
read of padding shows.

Twins run one live row at a time. The kernels are batch-invariant (a row rides on the narrow side
of every MMA, so its bits do not depend on its batch-mates); torch's CPU GEMMs are not (MKL's
blocking depends on the row count). Row-at-a-time twin calls keep that invariance, and
reference/model.py's Precision "matched" computes the same way, so twins equal it bit for bit.
The sampler twin is called on the same row groups as reference/speculative.py (all verification
rows together, one draft row at a time).

Dimension letters as in iquestrt/ops.py.
"""

from __future__ import annotations

import torch

from iquestrt.live import Live, host_seed
from iquestrt.ops_kernels import ROLLBACK_ROWS
from iquestrt.weights import Fp8Linear, MoeWeights
from kernels.sampler_values import DeviceSampling
from reference import dense_twins, fp8_ops, kv_layout, sampling_twins
from reference import ops as ref_ops
from reference import tails as t_tails
from reference.op_types import (
    AttnTailOut,
    EntryNorms,
    EntrySource,
    MoeTailOut,
    SampleOut,
    VerifyOut,
)

NAN = float("nan")


def _rows(n: int, fn) -> torch.Tensor:
    """[n, …]: fn(r) [1, …] for each live row r, one twin call per row."""
    return torch.cat([fn(r) for r in range(n)])


def _tensor_parts(parts) -> None:
    if not isinstance(parts, torch.Tensor):
        raise ValueError(f"twins: partials must be one tensor [N, R, H], got "
                         f"{type(parts).__name__} (peer reduction needs ops='kernels')")


def _padded(live_rows: torch.Tensor, rows: int, device, fill=NAN) -> torch.Tensor:
    out = torch.full((rows, *live_rows.shape[1:]), fill, dtype=live_rows.dtype, device=device)
    out[: live_rows.shape[0]] = live_rows.to(device)
    return out


def _into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """y, or y copied into the caller's buffer `out` (the kernels write there directly)."""
    if out is None:
        return y
    return out.copy_(y)


def _host_int(x) -> int:
    """A base scalar of draft_entry (host int or device [1] tensor) as a host int (twins)."""
    return x if isinstance(x, int) else int(x.reshape(-1)[0])


class DequantCache:
    """ops.dequant_block memoized per weight: the twins call it for every row, which dominated
    their time. Keyed by storage, offset, shape and the in-place version counters of weight and
    scales, so a weight changed in place (tests poison weights mid-request) is dequantized anew;
    the values are those of the uncached call, bit for bit."""

    def __init__(self):
        self.table: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                tuple(t.stride()), t._version)

    def __call__(self, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        key = self._key(w) + self._key(s)
        hit = self.table.get(key)
        if hit is None:
            hit = self.table[key] = ref_ops.dequant_block(w.cpu(), s.cpu())
        return hit


class TwinOps:
    name = "twins"

    def __init__(self, device: torch.device, max_polls: int):
        self.dev = device
        self.dq = DequantCache()

    def reset(self) -> None:
        pass

    def linear_fp8(self, x, lin: Fp8Linear, live: Live, out_dtype) -> torch.Tensor:
        y = _rows(live.n, lambda r: dense_twins.linear_fp8_ref(x[r : r + 1], lin.w, lin.s,
                                                                out_dtype=out_dtype,
                                                                dequant=self.dq))
        return _padded(y, x.shape[0], self.dev)  # [R, N]

    def linear_fp8_partials(self, x, lin: Fp8Linear, live: Live, xq=None, out=None
                            ) -> torch.Tensor:
        """[1, R, N] FP32: the twin is one GEMM, i.e. a single partial. xq (a producer's
        quantization of x) is not needed: the twin quantizes x itself, to the same values."""
        return _into(self.linear_fp8(x, lin, live, torch.float32)[None], out)

    def linear_bf16_f32(self, x, w, live: Live, out_dtype) -> torch.Tensor:
        y = _rows(live.n, lambda r: dense_twins.linear_bf16_f32_ref(x[r : r + 1], w,
                                                                     out_dtype=out_dtype))
        return _padded(y, x.shape[0], self.dev)

    def qk_rope(self, parts, q_norm, k_norm, positions, table, live: Live, *, num_q_heads,
                num_kv_heads, eps):
        outs = [dense_twins.qk_rope_ref(parts[:, r : r + 1], q_norm, k_norm, positions[r : r + 1],
                                        table, num_q_heads=num_q_heads,
                                        num_kv_heads=num_kv_heads, eps=eps)
                for r in range(live.n)]
        rows = parts.shape[1]
        return tuple(_padded(torch.cat([o[i] for o in outs]), rows, self.dev) for i in range(3))

    def write_kv(self, cache, k, v, positions, live: Live) -> None:
        kv_layout.write_ref(cache, k, v, positions, live.n)

    def rollback(self, cache, keep, written) -> None:
        keep, written = int(keep), int(written)  # device scalars on the CPU: free reads
        if not 0 <= written - keep <= ROLLBACK_ROWS:
            raise ValueError(f"rollback: {written} − {keep} positions outside "
                             f"[0, {ROLLBACK_ROWS}]")
        kv_layout.rollback_ref(cache, keep, written)

    def attention(self, q, cache, positions, live: Live, sink_k, scale) -> torch.Tensor:
        out = torch.full(q.shape, NAN, dtype=q.dtype, device=self.dev)
        return kv_layout.attention_ref(q, cache, positions, live.n, sink_k, scale, out=out)

    def attention_q(self, q, cache, positions, live: Live, sink_k, scale):
        """→ (o, None): the twin O projection quantizes o itself."""
        return self.attention(q, cache, positions, live, sink_k, scale), None

    def attn_tail(self, parts, xn, attn_out_norm, ffn_norm, live: Live, flag, *, eps,
                  attn_out_scale, router_w=None, top_k=0, quantize=False) -> AttnTailOut:
        _tensor_parts(parts)
        outs = [t_tails.attn_tail_ref(parts[:, r : r + 1], xn[r : r + 1], attn_out_norm, ffn_norm,
                                      1, flag, eps=eps, attn_out_scale=attn_out_scale,
                                      router_w=router_w, top_k=top_k)
                for r in range(live.n)]
        rows = parts.shape[1]
        res = AttnTailOut(_padded(torch.cat([o.h for o in outs]), rows, self.dev),
                          _padded(torch.cat([o.f_in for o in outs]), rows, self.dev))
        if router_w is not None:
            res.ids = _padded(torch.cat([o.ids for o in outs]), rows, self.dev, -1)
            res.weights = _padded(torch.cat([o.weights for o in outs]), rows, self.dev)
        if quantize:
            res.fq, res.sf = self._quantized(torch.cat([o.f_in for o in outs]), rows)
        return res

    def moe_tail(self, parts, h, next_norm, live: Live, flag, *, eps, ffn_out_scale,
                 quantize=False) -> MoeTailOut:
        _tensor_parts(parts)
        xn = _rows(live.n, lambda r: t_tails.moe_tail_ref(
            parts[:, r : r + 1], h[r : r + 1], next_norm, 1, flag, eps=eps,
            ffn_out_scale=ffn_out_scale).xn)
        out = MoeTailOut(_padded(xn, parts.shape[1], self.dev))
        if quantize:
            out.xq, out.sx = self._quantized(xn, parts.shape[1])
        return out

    def _quantized(self, x, rows: int):
        """reference quantize_act of the live rows x [n, H], padded to R rows with NaN (rows a
        quantizing kernel leaves unwritten)."""
        q, s = ref_ops.quantize_act(x.float())
        return _padded(q.float(), rows, self.dev).to(q.dtype), _padded(s, rows, self.dev)

    def moe(self, x, weights, ids, m: MoeWeights, live: Live, out_dtype, xq=None, out=None
            ) -> torch.Tensor:
        """xq (a producer's quantization of x) is not needed: the twin quantizes x itself."""
        y = _rows(live.n, lambda r: fp8_ops.moe_fp8_ref(
            x[r : r + 1], weights[r : r + 1], ids[r : r + 1], m.fc, m.fc_s, m.proj, m.proj_s,
            out_dtype=out_dtype, dequant=self.dq))
        return _into(_padded(y, x.shape[0], self.dev), out)

    def sample(self, logits, params, seed, positions, purpose, live: Live) -> SampleOut:
        if isinstance(params, DeviceSampling):  # the twins run on the host: its parameters
            params = params.params
        tok, ids, probs = sampling_twins.sample_ref(logits, params, host_seed(seed), positions,
                                                    purpose, n_live=live.n)
        rows = logits.shape[0]
        return SampleOut(_padded(tok, rows, self.dev, -1), _padded(ids, rows, self.dev, -1),
                         _padded(probs, rows, self.dev, 0.0))

    def verify(self, p: SampleOut, q_ids, q_probs, drafts, seed, first,
               n_drafts: Live) -> VerifyOut:
        first = int(first) if not isinstance(first, torch.Tensor) else int(first.reshape(-1)[0])
        a, tok, bonus, emitted = sampling_twins.verify_ref(
            p.ids, p.probs, q_ids, q_probs, drafts, host_seed(seed), first, n_drafts=n_drafts.n)
        em = torch.full((drafts.shape[0] + 1,), -1, dtype=torch.int64, device=self.dev)
        em[: len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
        i32 = dict(dtype=torch.int32, device=self.dev)
        return VerifyOut(torch.tensor([a], **i32),
                         torch.tensor([tok], dtype=torch.int64, device=self.dev),
                         torch.tensor([int(bonus)], **i32), em)

    # --- row parts (kernels/rows.py): the torch expressions of reference/model.py, row by row
    def norm_rows(self, a, w, live: Live, eps, *, b=None, wb=None, sum_dtype=torch.float32,
                  store_sum=False, y_out=None, y_dtype=torch.bfloat16):
        rows = a.shape[0]
        s_out = torch.full(a.shape, NAN, dtype=sum_dtype, device=self.dev) if store_sum else None
        y = None
        if w is not None:
            y = y_out if y_out is not None else torch.full(a.shape, NAN, dtype=y_dtype,
                                                           device=self.dev)
        for r in range(min(live.n, rows)):
            s_r = a[r : r + 1]
            if b is not None:
                t = ref_ops.rms_norm(b[r : r + 1], wb, eps)
                s_r = (s_r.float() + t.float()).to(sum_dtype)
                if store_sum:
                    s_out[r : r + 1] = s_r
            if y is not None:
                y[r : r + 1] = ref_ops.rms_norm(s_r, w, eps, y.dtype)
        return s_out, y

    def draft_entry(self, src: EntrySource, live: Live, norms: EntryNorms, eh_out, pos_out):
        """The composition the entry launch replaces: gather with the launch's clamps (token
        slot to [0, tok_max], token id to [0, V − 1], hidden row to [0, S − 1]), embed, the two
        norm_rows twins into eh_out's halves (live rows only), pos = base + r or −1."""
        embed, eps = norms.embed, norms.eps
        rows, h_size = eh_out.shape[0], embed.shape[1]
        ar = torch.arange(rows, device=src.tokens.device)  # [R]
        slot = (_host_int(src.tok_base) + ar).clamp(0, src.tok_max)
        tok = src.tokens[slot].clamp(0, embed.shape[0] - 1)  # [R]
        hid = src.hidden
        hrow = (_host_int(src.hid_base) + ar).clamp(0, hid.shape[0] - 1).to(hid.device)
        self.norm_rows(embed[tok.to(embed.device)], norms.enorm, live, eps,
                       y_out=eh_out[:, :h_size])
        self.norm_rows(hid[hrow], norms.hnorm, live, eps, y_out=eh_out[:, h_size:])
        ar = ar.to(pos_out.device)
        pos_out.copy_(torch.where(ar < live.n, _host_int(src.pos_base) + ar, -1))
        return eh_out, pos_out

    def eh_proj(self, src: EntrySource, live: Live, norms: EntryNorms, weight, pos_out):
        """The composition the fused kernel replaces: draft_entry, then eh_proj's linear
        (bf16 out) → (x [R, N], pos_out)."""
        eh = torch.zeros(pos_out.shape[0], 2 * norms.embed.shape[1], dtype=torch.bfloat16,
                         device=self.dev)
        self.draft_entry(src, live, norms, eh, pos_out)
        return self.linear_bf16_f32(eh, weight, live, torch.bfloat16), pos_out

    def silu_mul_rows(self, g, u, live: Live):
        act = _rows(live.n, lambda r: ref_ops.silu_mul(g[r : r + 1], u[r : r + 1],
                                                       torch.bfloat16))
        return _padded(act, g.shape[0], self.dev)

    def route_rows(self, x, router_w, top_k: int, live: Live):
        outs = [ref_ops.route(x[r : r + 1], router_w, top_k) for r in range(live.n)]
        rows = x.shape[0]
        wts = _padded(torch.cat([o[0] for o in outs]), rows, self.dev)
        ids = _padded(torch.cat([o[1] for o in outs]).to(torch.int32), rows, self.dev, -1)
        return wts, ids
