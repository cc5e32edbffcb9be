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
from kernels.sampler.values import DeviceSampling
from reference import ops as ref_ops
from reference.op_types import (
    AttnTailOut,
    DraftRecord,
    EntryNorms,
    EntrySource,
    FaultLog,
    MoeTailOut,
    RoundBegin,
    RoundState,
    SampleOut,
    SettleBounds,
    TargetRows,
    VerifyOut,
)
from reference.twins import attention as t_attention
from reference.twins import draft_entry as t_entry
from reference.twins import eh_proj as t_eh
from reference.twins import kv_cache as t_kv
from reference.twins import linear as t_linear
from reference.twins import moe as t_moe
from reference.twins import qk_rope as t_qk
from reference.twins import round_record as t_record
from reference.twins import round_scalars as t_scalars
from reference.twins import rows as t_rows
from reference.twins import sampler as t_sampler
from reference.twins import tails as t_tails
from reference.twins import verify as t_verify

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


class DequantCache:
    """ops.dequant_block memoized per weight: the twins call it for every row, which dominated
    their time. Keyed by storage, offset, shape and the in-place version counters of weight and
    scales, so a weight changed in place (tests poison weights mid-request) is dequantized anew;
    the values are those of the uncached call, bit for bit, held in FP64 (FP32 → FP64 is exact):
    the twins use them only as ops.gemm's FP64 operand, which then converts no weight per row."""

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
            hit = self.table[key] = ref_ops.dequant_block(w.cpu(), s.cpu()).double()
        return hit


class TwinOps:
    name = "twins"

    def __init__(self, device: torch.device, max_polls: int):
        self.dev = device
        self.dq = DequantCache()

    def reset(self) -> None:
        pass

    def linear_fp8(self, x, lin: Fp8Linear, live: Live, out_dtype) -> torch.Tensor:
        y = _rows(live.n, lambda r: t_linear.linear_fp8_ref(x[r : r + 1], lin.w, lin.s,
                                                                out_dtype=out_dtype,
                                                                dequant=self.dq))
        return _padded(y, x.shape[0], self.dev)  # [R, N]

    def linear_fp8_partials(self, x, lin: Fp8Linear, live: Live, xq=None, out=None
                            ) -> torch.Tensor:
        """[1, R, N] FP32: the twin is one GEMM, i.e. a single partial. xq (a producer's
        quantization of x) is not needed: the twin quantizes x itself, to the same values."""
        return _into(self.linear_fp8(x, lin, live, torch.float32)[None], out)

    def linear_bf16_f32(self, x, w, live: Live, out_dtype) -> torch.Tensor:
        y = _rows(live.n, lambda r: t_linear.linear_bf16_f32_ref(x[r : r + 1], w,
                                                                     out_dtype=out_dtype))
        return _padded(y, x.shape[0], self.dev)

    def qkv_rope(self, x, lin: Fp8Linear, q_norm, k_norm, positions, table, live: Live, *,
                 num_q_heads, num_kv_heads, eps, xq=None, cache=None):
        """qkv_rope_ref's composition through this table's own two ops (a stand-in replacing
        qk_rope reaches it)."""
        parts = self.linear_fp8_partials(x, lin, live, xq=xq)
        return (parts, *self.qk_rope(parts, q_norm, k_norm, positions, table, live,
                                     num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                     eps=eps, cache=cache))

    def qk_rope(self, parts, q_norm, k_norm, positions, table, live: Live, *, num_q_heads,
                num_kv_heads, eps, cache=None):
        outs = [t_qk.qk_rope_ref(parts[:, r : r + 1], q_norm, k_norm, positions[r : r + 1],
                                        table, num_q_heads=num_q_heads,
                                        num_kv_heads=num_kv_heads, eps=eps)
                for r in range(live.n)]
        rows = parts.shape[1]
        q, k, v = (_padded(torch.cat([o[i] for o in outs]), rows, self.dev) for i in range(3))
        if cache is not None:
            t_kv.write_ref(cache, k, v, positions, live.n)
        return q, k, v

    def rollback(self, cache, keep, written) -> None:
        keep, written = int(keep), int(written)  # device scalars on the CPU: free reads
        if not 0 <= written - keep <= ROLLBACK_ROWS:
            raise ValueError(f"rollback: {written} − {keep} positions outside "
                             f"[0, {ROLLBACK_ROWS}]")
        t_kv.rollback_ref(cache, keep, written)

    def rollback_layers(self, caches, keep, written) -> None:
        """self.rollback per cache (rollback_layers_ref's loop): a stand-in that replaces
        rollback reaches every layer."""
        for cache in caches:
            self.rollback(cache, keep, written)

    def attention(self, q, cache, positions, live: Live, sink_k, scale) -> torch.Tensor:
        out = torch.full(q.shape, NAN, dtype=q.dtype, device=self.dev)
        return t_attention.attention_ref(q, cache, positions, live.n, sink_k, scale, out=out)

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
        y = _rows(live.n, lambda r: t_moe.moe_fp8_ref(
            x[r : r + 1], weights[r : r + 1], ids[r : r + 1], m.fc, m.fc_s, m.proj, m.proj_s,
            out_dtype=out_dtype, dequant=self.dq))
        return _into(_padded(y, x.shape[0], self.dev), out)

    def sample(self, logits, params, seed, positions, purpose, live: Live) -> SampleOut:
        if isinstance(params, DeviceSampling):  # the twins run on the host: its parameters
            params = params.params
        tok, ids, probs = t_sampler.sample_ref(logits, params, host_seed(seed),
                                               positions.long(),  # the kernel takes int32 too
                                               purpose, n_live=live.n)
        rows = logits.shape[0]
        return SampleOut(_padded(tok, rows, self.dev, -1), _padded(ids, rows, self.dev, -1),
                         _padded(probs, rows, self.dev, 0.0))

    def verify(self, p: SampleOut, q_ids, q_probs, drafts, seed, first,
               n_drafts: Live) -> VerifyOut:
        first = int(first) if not isinstance(first, torch.Tensor) else int(first.reshape(-1)[0])
        a, tok, bonus, emitted = t_verify.verify_ref(
            p.ids, p.probs, q_ids, q_probs, drafts, host_seed(seed), first, n_drafts=n_drafts.n)
        em = torch.full((drafts.shape[0] + 1,), -1, dtype=torch.int64, device=self.dev)
        em[: len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
        i32 = dict(dtype=torch.int32, device=self.dev)
        return VerifyOut(torch.tensor([a], **i32),
                         torch.tensor([tok], dtype=torch.int64, device=self.dev),
                         torch.tensor([int(bonus)], **i32), em)

    # --- row parts (kernels/rows.py, kernels/draft_entry.py, kernels/eh_proj.py)
    def begin_round(self, s: RoundState, rec: DraftRecord, b: RoundBegin, *, clear_from) -> None:
        t_scalars.begin_round_ref(s, rec, b, clear_from=clear_from)

    def target_rows(self, s: RoundState, rec: DraftRecord, b: RoundBegin, t: TargetRows) -> None:
        t_scalars.target_rows_ref(s, rec, b, t)

    def settle_bounds(self, v: VerifyOut, s: RoundState, t: TargetRows, go,
                      out: SettleBounds, *, recompute) -> None:
        t_scalars.settle_bounds_ref(v, s, t, go, out, recompute=recompute)

    def check_flags(self, flags, ran, log: FaultLog, *, code) -> None:
        t_record.check_flags_ref(flags, ran, log, code=code)

    def check_logits(self, logits, live: Live, log: FaultLog, *, code, where) -> None:
        t_record.check_logits_ref(logits, live.t, log, code=code, where=where)

    def record_draft(self, out: SampleOut, one, j, rec: DraftRecord, log: FaultLog, *, vocab,
                     code) -> None:
        t_record.record_draft_ref(out, one, j, rec, log, vocab=vocab, code=code)

    def settle_round(self, v: VerifyOut, keep_d, hidden, rec: DraftRecord, s: RoundState, *,
                     vocab, code) -> None:
        t_record.settle_round_ref(v, keep_d, hidden, rec, s, vocab=vocab, code=code)

    def norm_rows(self, a, w, live: Live, eps, *, b=None, wb=None, sum_dtype=torch.float32,
                  store_sum=False, y_out=None, y_dtype=torch.bfloat16):
        return t_rows.norm_rows_ref(a, w, live.n, eps, b=b, wb=wb, sum_dtype=sum_dtype,
                                    store_sum=store_sum, y_out=y_out, y_dtype=y_dtype)

    def draft_entry(self, src: EntrySource, live: Live, norms: EntryNorms, eh_out, pos_out):
        return t_entry.draft_entry_ref(src.tokens, src.tok_base, src.tok_max, src.hidden,
                                       src.hid_base, src.pos_base, live.n, norms.embed,
                                       norms.enorm, norms.hnorm, norms.eps, eh_out, pos_out)

    def eh_proj(self, src: EntrySource, live: Live, norms: EntryNorms, weight, pos_out):
        return t_eh.eh_proj_ref(src.tokens, src.tok_base, src.tok_max, src.hidden, src.hid_base,
                                src.pos_base, live.n, norms.embed, norms.enorm, norms.hnorm,
                                norms.eps, weight, pos_out)

    def silu_mul_rows(self, g, u, live: Live):
        return _padded(t_rows.silu_mul_rows_ref(g, u, live.n), g.shape[0], self.dev)

    def route_rows(self, x, router_w, top_k: int, live: Live):
        wts, ids = t_rows.route_rows_ref(x, router_w, top_k, live.n)
        rows = x.shape[0]
        return _padded(wts, rows, self.dev), _padded(ids, rows, self.dev, -1)
