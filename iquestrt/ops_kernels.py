"""The "kernels" implementation of iquestrt/ops.py's op table: the Triton wrappers of kernels/
(compiled on a GPU, interpreted on the CPU), reading the live-row count from the device.

Dimension letters as in iquestrt/ops.py.
"""

from __future__ import annotations

import os

import torch

from iquestrt.launch_overrides import LaunchOverrides
from iquestrt.live import Live
from iquestrt.weights import Fp8Linear, MoeWeights
from kernels import attention as k_attention
from kernels import draft_entry as k_entry
from kernels import eh_proj as k_eh_proj
from kernels import kv_cache as k_kv
from kernels import linear as k_linear
from kernels import moe as k_moe
from kernels import qk_rope as k_qk
from kernels import round_record as k_record
from kernels import round_scalars as k_scalars
from kernels import rows as k_rows
from kernels import sampler as k_sampler
from kernels import tails as k_tails
from kernels import verify as k_verify
from kernels.fp8 import E4M3
from kernels.launch import check_pdl
from kernels.peer_partials import RingRead
from kernels.router import RouteScratch
from kernels.row_chunks import RowChunkScratch
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

ROLLBACK_ROWS = 8  # the rollback kernel's width: positions one settlement may relabel


class KernelOps:
    name = "kernels"

    def __init__(self, device: torch.device, max_polls: int, pdl: bool = False,
                 launches: LaunchOverrides | None = None):
        """launches: overrides of the pinned launch configurations (iquestrt/launch_overrides.py;
        empty: the pinned ones), for side-by-side benchmarks."""
        check_pdl(pdl, device)
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "ops='kernels' on the CPU needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "before the first import of a kernels module (or use ops='twins')"
            )
        self.dev, self.max_polls, self.pdl = device, max_polls, pdl
        self.launches = launches or LaunchOverrides()
        self._scratch: dict[tuple[int, int], k_tails.RouterScratch] = {}
        self._route_scratch: dict[tuple[int, int], RouteScratch] = {}  # the draft's route_rows
        self.moe_scratch = k_moe.MoeScratch.create(device)  # the folded SiLU's counters
        self.row_chunks = RowChunkScratch.create(device)  # the chunked tails' counters
        self.qkv = self.launches.qkv_config()
        self.qkv_scratch = k_qk.QkvRopeScratch.create(device)  # the folded prologue's counters
        # rollback_layers' device tables, one per list of caches (LayerTable.key); never
        # dropped: a captured round graph keeps reading the one it captured
        self._layer_tables: dict[tuple, k_kv.LayerTable] = {}

    def reset(self) -> None:
        """After a failure flag: restore the router, MoE, row-chunk and folded-QKV scratch
        invariants (kernels/tails.py, kernels/moe.py, kernels/row_chunks.py,
        kernels/qk_rope.py)."""
        for s in [*self._scratch.values(), *self._route_scratch.values(), self.moe_scratch,
                  self.row_chunks, self.qkv_scratch]:
            s.reset()

    def linear_fp8(self, x, lin: Fp8Linear, live: Live, out_dtype) -> torch.Tensor:
        return k_linear.linear_fp8(x, lin.w, lin.s, live.t, out_dtype=out_dtype, pdl=self.pdl,
                                   config=self.launches.linear_config(*lin.w.shape))

    def linear_fp8_partials(self, x, lin: Fp8Linear, live: Live, xq=None, out=None
                            ) -> torch.Tensor:
        return k_linear.linear_fp8_partials(  # [S, R, N]
            x, lin.w, lin.s, live.t, quantized=xq, out=out, pdl=self.pdl,
            config=self.launches.linear_config(*lin.w.shape))

    def linear_bf16_f32(self, x, w, live: Live, out_dtype) -> torch.Tensor:
        return k_linear.linear_bf16_f32(x, w, live.t, out_dtype=out_dtype, pdl=self.pdl)

    def qkv_rope(self, x, lin: Fp8Linear, q_norm, k_norm, positions, table, live: Live, *,
                 num_q_heads, num_kv_heads, eps, xq=None, cache=None):
        """QkvLaunch.fold_rope: one launch (kernels/qk_rope.py qkv_rope), else the two."""
        args = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, eps=eps, cache=cache)
        if self.qkv.fold_rope:
            return k_qk.qkv_rope(x, lin.w, lin.s, q_norm, k_norm, positions, table, live.t,
                                 scratch=self.qkv_scratch, quantized=xq, pdl=self.pdl,
                                 config=self.launches.linear_config(*lin.w.shape), **args)
        parts = self.linear_fp8_partials(x, lin, live, xq=xq)
        return (parts, *self.qk_rope(parts, q_norm, k_norm, positions, table, live, **args))

    def qk_rope(self, parts, q_norm, k_norm, positions, table, live: Live, *, num_q_heads,
                num_kv_heads, eps, cache=None):
        """With a cache: the KV write in the same launch."""
        return k_qk.qk_rope(parts, q_norm, k_norm, positions, table, live.t,
                            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, eps=eps,
                            cache=cache, pdl=self.pdl)

    def rollback(self, cache, keep, written) -> None:
        """keep/written: host ints, or device [1] scalars (a device-resident round)."""
        k_kv.rollback(cache, keep, written, max_rows=ROLLBACK_ROWS, pdl=self.pdl)

    def rollback_layers(self, caches, keep, written) -> None:
        """One launch for all caches."""
        k_kv.rollback_layers(caches, keep, written, max_rows=ROLLBACK_ROWS,
                             tables=self._layer_tables, pdl=self.pdl)

    def _attention_config(self, cache) -> k_attention.AttentionConfig:
        lay = cache.layout
        return self.launches.attention_config(lay.head_dim, lay.capacity, lay.ring)

    def attention(self, q, cache, positions, live: Live, sink_k, scale) -> torch.Tensor:
        return k_attention.attention(q, cache, positions, live.t, sink_k, scale,
                                     config=self._attention_config(cache), pdl=self.pdl)

    def attention_q(self, q, cache, positions, live: Live, sink_k, scale):
        """→ (o [R, Hq, D], (E4M3 [R, Hq·D], scales) = quantize_act of o made by the combine
        launch, or None when its programs do not cover whole 128-column groups)."""
        r, hq, d = q.shape
        cfg = self._attention_config(cache)
        if not k_attention.combine_quantizes(hq, d, cfg.combine_heads):
            return self.attention(q, cache, positions, live, sink_k, scale), None
        xq = (torch.empty(r, hq * d, dtype=E4M3, device=self.dev),
              torch.empty(r, -(-hq * d // 128), dtype=torch.float32, device=self.dev))
        o = k_attention.attention(q, cache, positions, live.t, sink_k, scale, config=cfg,
                                  quant_out=xq, pdl=self.pdl)
        return o, xq

    def attn_tail(self, parts, xn, attn_out_norm, ffn_norm, live: Live, flag, *, eps,
                  attn_out_scale, router_w=None, top_k=0, quantize=False) -> AttnTailOut:
        scratch = None
        if router_w is not None:
            key = tuple(router_w.shape)
            if key not in self._scratch:
                self._scratch[key] = k_tails.RouterScratch.create(key[1], key[0], self.dev)
            scratch = self._scratch[key]
        parts, rearm, polls = self._read(parts)
        return k_tails.attn_tail(parts, xn, attn_out_norm, ffn_norm, live.t, flag, eps=eps,
                                 attn_out_scale=attn_out_scale, max_polls=polls, rearm=rearm,
                                 router_w=router_w, top_k=top_k, scratch=scratch,
                                 chunk_scratch=self.row_chunks,
                                 quantize=quantize, pdl=self.pdl,
                                 config=self.launches.tail_config(
                                     xn.shape[-1], 0 if router_w is None else router_w.shape[0]))

    def moe_tail(self, parts, h, next_norm, live: Live, flag, *, eps, ffn_out_scale,
                 quantize=False) -> MoeTailOut:
        parts, rearm, polls = self._read(parts)
        return k_tails.moe_tail(parts, h, next_norm, live.t, flag, eps=eps,
                                ffn_out_scale=ffn_out_scale, max_polls=polls, rearm=rearm,
                                quantize=quantize, pdl=self.pdl, chunk_scratch=self.row_chunks,
                                config=self.launches.tail_config(h.shape[-1]))

    def _read(self, parts):
        """Partials [N, R, H], or a RingRead of peers' slots → (partials, re-arm, poll bound)."""
        if isinstance(parts, RingRead):
            return parts.partials, parts.rearm, parts.max_polls
        return parts, None, self.max_polls

    def moe(self, x, weights, ids, m: MoeWeights, live: Live, out_dtype, xq=None, out=None
            ) -> torch.Tensor:
        return k_moe.moe_fp8(x, weights, ids, m.fc, m.fc_s, m.proj, m.proj_s, live.t,
                             out_dtype=out_dtype, quantized=xq, out=out,
                             scratch=self.moe_scratch, pdl=self.pdl, config=self._moe_config(x, m))

    def _moe_config(self, x, m: MoeWeights):
        """The MoE's launch configuration under self.launches; None: the pinned one."""
        return self.launches.moe_config(x.shape[-1], m.fc.shape[1] // 2, self.dev.type)

    def sample(self, logits, params, seed, positions, purpose, live: Live) -> SampleOut:
        return k_sampler.sample(logits, params, seed, positions, purpose, n_live=live.t,
                                pdl=self.pdl, config=self.launches.sampler_config(logits.shape[1]))

    def verify(self, p: SampleOut, q_ids, q_probs, drafts, seed, first,
               n_drafts: Live) -> VerifyOut:
        return k_verify.verify(p.ids, p.probs, q_ids, q_probs, drafts, seed, first,
                               n_drafts=n_drafts.t, pdl=self.pdl)

    def begin_round(self, s: RoundState, rec: DraftRecord, b: RoundBegin, *, clear_from) -> None:
        k_scalars.begin_round(s, rec, b, clear_from=clear_from, pdl=self.pdl)

    def target_rows(self, s: RoundState, rec: DraftRecord, b: RoundBegin, t: TargetRows) -> None:
        k_scalars.target_rows(s, rec, b, t, pdl=self.pdl)

    def settle_bounds(self, v: VerifyOut, s: RoundState, t: TargetRows, go,
                      out: SettleBounds, *, recompute) -> None:
        k_scalars.settle_bounds(v, s, t, go, out, recompute=recompute, pdl=self.pdl)

    def check_flags(self, flags, ran, log: FaultLog, *, code) -> None:
        k_record.check_flags(flags, ran, log, code=code, pdl=self.pdl)

    def check_logits(self, logits, live: Live, log: FaultLog, *, code, where) -> None:
        k_record.check_logits(logits, live.t, log, code=code, where=where, pdl=self.pdl)

    def record_draft(self, out: SampleOut, one, j, rec: DraftRecord, log: FaultLog, *, vocab,
                     code) -> None:
        k_record.record_draft(out, one, j, rec, log, vocab=vocab, code=code, pdl=self.pdl)

    def settle_round(self, v: VerifyOut, keep_d, hidden, rec: DraftRecord, s: RoundState, *,
                     vocab, code) -> None:
        k_record.settle_round(v, keep_d, hidden, rec, s, vocab=vocab, code=code, pdl=self.pdl)

    def norm_rows(self, a, w, live: Live, eps, *, b=None, wb=None, sum_dtype=torch.float32,
                  store_sum=False, y_out=None, y_dtype=torch.bfloat16):
        return k_rows.norm_rows(a, w, live.t, eps, b=b, wb=wb, sum_dtype=sum_dtype,
                                store_sum=store_sum, y_out=y_out, y_dtype=y_dtype,
                                pdl=self.pdl)

    def draft_entry(self, src: EntrySource, live: Live, norms: EntryNorms, eh_out, pos_out):
        return k_entry.draft_entry(src.tokens, src.tok_base, src.tok_max, src.hidden,
                                   src.hid_base, src.pos_base, live.t, norms.embed, norms.enorm,
                                   norms.hnorm, norms.eps, eh_out, pos_out, pdl=self.pdl)

    def eh_proj(self, src: EntrySource, live: Live, norms: EntryNorms, weight, pos_out):
        return k_eh_proj.eh_proj(src.tokens, src.tok_base, src.tok_max, src.hidden,
                                 src.hid_base, src.pos_base, live.t, norms.embed, norms.enorm,
                                 norms.hnorm, norms.eps, weight, pos_out, pdl=self.pdl)

    def silu_mul_rows(self, g, u, live: Live):
        return k_rows.silu_mul_rows(g, u, live.t, pdl=self.pdl)

    def route_rows(self, x, router_w, top_k: int, live: Live):
        key = tuple(router_w.shape)
        if key not in self._route_scratch:
            self._route_scratch[key] = RouteScratch.create(key[0], self.dev)
        return k_rows.route_rows(x, router_w, top_k, live.t, scratch=self._route_scratch[key],
                                 pdl=self.pdl)
