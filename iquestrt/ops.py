"""The one table of device ops the runtime model calls — declared here as `OpTable`, the
contract — in two implementations of identical semantics: "kernels" (iquestrt/ops_kernels.py:
the Triton wrappers of kernels/, compiled on a GPU, interpreted on the CPU) and "twins"
(iquestrt/ops_twins.py: their reference twins). Nothing outside these files knows which one
runs; tests/engine/test_op_table.py holds both (and every wrapper that stands in for one: the
lockstep gate, the TP and planted tables) to this declaration, parameter for parameter.

Conventions (the kernels'): every op works on a padded buffer of R rows (R = max_width), of which
the first n are live; `Live` carries n as a device int32 [1] (what kernels read) and as a host int
(what twins and the torch parts read). Outputs are [R, …]; padding rows are never read. Twins
return live rows only; their adapters write them into padded outputs whose padding rows hold
NaN (ids −1), so a read of padding shows. Result and argument types: reference/op_types.py.

Dimension letters: R rows (buffer), n live rows, S split-K partials, N/K GEMM out/in, H hidden,
Hq/Hkv heads, D head dim, E experts, K top-k, V vocabulary, W served width, Db draft buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from iquestrt.live import Live, host_seed
from iquestrt.ops_kernels import ROLLBACK_ROWS, KernelOps
from iquestrt.ops_twins import TwinOps
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

if TYPE_CHECKING:
    from collections.abc import Sequence

    from iquestrt.weights import Fp8Linear, MoeWeights
    from kernels.peer_partials import RingRead
    from kernels.qk_rope import RopeTable
    from kernels.sampler.values import DeviceSampling
    from reference.config import SamplingDefaults
    from reference.kv_layout import LayerKV
    from reference.rng import Purpose

__all__ = ["ROLLBACK_ROWS", "AttnTailOut", "EntryNorms", "EntrySource", "KernelOps", "Live",
           "MoeTailOut", "OpTable", "SampleOut", "TwinOps", "VerifyOut", "host_seed", "make_ops"]

Tensor = torch.Tensor


@runtime_checkable
class OpTable(Protocol):
    """Every op the runtime model, the draft and the round program call. Each op reads only
    the live rows of its inputs; a kernel and its twin give the same bits wherever its row of
    qualification/tolerances.py is exact, and stay inside that row's band elsewhere."""

    name: str  # "kernels" | "twins"

    def reset(self) -> None:
        """After a failure flag: restore whatever scratch invariant the implementation keeps."""

    # --- dense GEMMs ----------------------------------------------------------------------------
    def linear_fp8(self, x: Tensor, lin: Fp8Linear, live: Live, out_dtype: torch.dtype
                   ) -> Tensor:
        """x [R, K] bf16 · block-FP8 lin [N, K]ᵀ → [R, N] out_dtype (x quantized per row and
        128-column group, as the checkpoint's weights are)."""

    def linear_fp8_partials(self, x: Tensor, lin: Fp8Linear, live: Live,
                            xq: tuple[Tensor, Tensor] | None = None, out: Tensor | None = None
                            ) -> Tensor:
        """→ [S, R, N] FP32 split-K partials whose in-order sum is linear_fp8's value; xq: a
        producer's quantization of x (E4M3 [R, K], scales [R, ⌈K/128⌉]) to reuse."""

    def linear_bf16_f32(self, x: Tensor, w: Tensor, live: Live, out_dtype: torch.dtype
                        ) -> Tensor:
        """x [R, K] bf16 · w [N, K]ᵀ bf16 with an FP32 sum → [R, N] out_dtype (lm_head,
        eh_proj)."""

    # --- attention -------------------------------------------------------------------------
    def qk_rope(self, parts: Tensor, q_norm: Tensor | None, k_norm: Tensor | None,
                positions: Tensor, table: RopeTable, live: Live, *, num_q_heads: int,
                num_kv_heads: int, eps: float, cache: LayerKV | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """QKV [R, (Hq + 2·Hkv)·D] bf16 or its partials [S, R, ·] FP32 → q [R, Hq, D],
        k [R, Hkv, D], v [R, Hkv, D] bf16: per-head RMS norm of q and k, RoPE at positions
        [R] int32. With the layer's cache, the live rows' k and v are stored in it too, at
        their positions' slots (ring slot p mod capacity on a sliding layer) with the slots'
        position labels; a negative position stores nothing."""

    def qkv_rope(self, x: Tensor, lin: Fp8Linear, q_norm: Tensor | None,
                 k_norm: Tensor | None, positions: Tensor, table: RopeTable, live: Live, *,
                 num_q_heads: int, num_kv_heads: int, eps: float,
                 xq: tuple[Tensor, Tensor] | None = None, cache: LayerKV | None = None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The attention prologue: linear_fp8_partials(x, lin, live, xq) then qk_rope on those
        partials (with the cache's write) → (partials [S, R, (Hq + 2·Hkv)·D], q, k, v). The
        kernels table may run both in one launch (QkvLaunch.fold_rope: the same bits)."""

    def rollback(self, cache: LayerKV, keep: int | Tensor, written: int | Tensor) -> None:
        """Positions [keep, written) are no longer in the cache: their slots are relabelled
        empty (at most ROLLBACK_ROWS of them); host ints, or device [1] scalars."""

    def rollback_layers(self, caches: Sequence[LayerKV], keep: int | Tensor,
                        written: int | Tensor) -> None:
        """rollback of every cache of caches with the same bounds (the target layers'
        settlement)."""

    def attention(self, q: Tensor, cache: LayerKV, positions: Tensor, live: Live,
                  sink_k: Tensor | None, scale: float) -> Tensor:
        """q [R, Hq, D] bf16 over the cache (each row sees the keys at positions ≤ its own,
        within its window) and the learned sink key [Hq] → o [R, Hq, D] bf16."""

    def attention_q(self, q: Tensor, cache: LayerKV, positions: Tensor, live: Live,
                    sink_k: Tensor | None, scale: float
                    ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """attention, and when the implementation makes it in the same launch, o's FP8
        quantization (E4M3 [R, Hq·D], scales [R, ⌈Hq·D/128⌉]) for the O projection; else None."""

    # --- layer tails -----------------------------------------------------------------------
    def attn_tail(self, parts: Tensor | RingRead, xn: Tensor, attn_out_norm: Tensor,
                  ffn_norm: Tensor, live: Live, flag: Tensor, *, eps: float,
                  attn_out_scale: float, router_w: Tensor | None = None, top_k: int = 0,
                  quantize: bool = False) -> AttnTailOut:
        """The O partials [N, R, H] (or the peers' ring slots) summed in order, normed and
        added to the residual xn [R, H]; the expert input normed; with router_w [E, H] the
        top_k routing of it; with quantize its FP8 quantization. flag [1] int32: set on a
        failure (a poll bound reached, a non-finite router score)."""

    def moe_tail(self, parts: Tensor | RingRead, h: Tensor, next_norm: Tensor, live: Live,
                 flag: Tensor, *, eps: float, ffn_out_scale: float, quantize: bool = False
                 ) -> MoeTailOut:
        """The expert partials [N, R, H] summed in order, scaled and added to h [R, H]; the
        next layer's normalized input."""

    # --- experts ---------------------------------------------------------------------------
    def moe(self, x: Tensor, weights: Tensor, ids: Tensor, m: MoeWeights, live: Live,
            out_dtype: torch.dtype, xq: tuple[Tensor, Tensor] | None = None,
            out: Tensor | None = None) -> Tensor:
        """x [R, H] bf16 through the routed experts ids [R, K] int32 weighted by weights [R, K]
        FP32 (gate/up, SiLU·mul, down; block FP8) → [R, H] out_dtype (or partials into out)."""

    # --- sampling --------------------------------------------------------------------------
    def sample(self, logits: Tensor, params: SamplingDefaults | DeviceSampling,
               seed: int | Tensor, positions: Tensor, purpose: Purpose, live: Live
               ) -> SampleOut:
        """logits [R, V] FP32 → each live row's token drawn with the counter-based uniform of
        (seed, position, purpose), and its served candidates and probabilities [R, W]."""

    def verify(self, p: SampleOut, q_ids: Tensor, q_probs: Tensor, drafts: Tensor,
               seed: int | Tensor, first: int | Tensor, n_drafts: Live) -> VerifyOut:
        """Rejection sampling of drafts [Db] against the target's served law p (rows 0..d) and
        the draft's q (q_ids / q_probs [Db, W]): accepted count, replacement or bonus."""

    # --- the round's bookkeeping -----------------------------------------------------------
    def begin_round(self, s: RoundState, rec: DraftRecord, b: RoundBegin, *,
                    clear_from: int) -> None:
        """Before depth 0: b from the state (go, catch-up rows, hidden base, last row, draft
        positions, control features); rec emptied, its q rows ≥ clear_from −1 / 0
        (reference.twins.round_scalars.begin_round_ref)."""

    def target_rows(self, s: RoundState, rec: DraftRecord, b: RoundBegin, t: TargetRows
                    ) -> None:
        """After the draft depths: the verification rows, positions and draws, and the draft
        cache's next position into t (reference.twins.round_scalars.target_rows_ref)."""

    def settle_bounds(self, v: VerifyOut, s: RoundState, t: TargetRows, go: Tensor,
                      out: SettleBounds, *, recompute: bool) -> None:
        """After verification: the caches' rollback bounds into out; recompute: the draft's
        "recompute" settlement (reference.twins.round_scalars.settle_bounds_ref)."""

    def check_flags(self, flags: Tensor, ran: Tensor, log: FaultLog, *, code: int) -> None:
        """Record the fault (code, round, index of the first raised flag, 0) in log when a
        flag of flags [L] int32 is raised, the round ran (ran [1] > 0) and no fault came first."""

    def check_logits(self, logits: Tensor, live: Live, log: FaultLog, *, code: int,
                     where: int) -> None:
        """Record the fault (code, round, where, 0) in log when a live row of logits [R, V]
        holds NaN or ±inf and no fault came first."""

    def record_draft(self, out: SampleOut, one: Tensor, j: int, rec: DraftRecord,
                     log: FaultLog, *, vocab: int, code: int) -> None:
        """Depth j's draft from its sample out (row 0) when one [1] int32 is 1: rec's row j =
        the served ids / probs and the token clamped into [0, vocab) (the fault (code, round, j,
        token) when it was outside), rec.n_d += one; with one = 0 row j is −1 / 0 / 0."""

    def settle_round(self, v: VerifyOut, keep_d: Tensor, hidden: Tensor, rec: DraftRecord,
                     s: RoundState, *, vocab: int, code: int) -> None:
        """The state after verification, caches already rolled back: the fault (code, round,
        −1, token) of a next token outside [0, vocab); when the round ran, draft_next = keep_d
        [1], hidden [R, H] and its base, the emitted tokens, the log row (head, emitted, rec),
        m, n_new, round, done (reference.twins.round_record.settle_round_ref)."""

    # --- row parts -------------------------------------------------------------------------
    def norm_rows(self, a: Tensor, w: Tensor | None, live: Live, eps: float, *,
                  b: Tensor | None = None, wb: Tensor | None = None,
                  sum_dtype: torch.dtype = torch.float32, store_sum: bool = False,
                  y_out: Tensor | None = None, y_dtype: torch.dtype = torch.bfloat16
                  ) -> tuple[Tensor | None, Tensor | None]:
        """s = a (+ rms_norm(b, wb)) [R, H]; y = rms_norm(s, w) → (s if store_sum, y)."""

    def draft_entry(self, src: EntrySource, live: Live, norms: EntryNorms, eh_out: Tensor,
                    pos_out: Tensor) -> tuple[Tensor, Tensor]:
        """The draft's operand rows gathered from src: eh_out [R, 2H] bf16 = (enorm(embed[tok]),
        hnorm(hidden)), pos_out [R] int32 = pos_base + r, −1 for padding rows."""

    def eh_proj(self, src: EntrySource, live: Live, norms: EntryNorms, weight: Tensor,
                pos_out: Tensor) -> tuple[Tensor, Tensor]:
        """draft_entry followed by eh_proj's linear (weight [H, 2H] bf16) → (x [R, H] bf16,
        pos_out)."""

    def silu_mul_rows(self, g: Tensor, u: Tensor, live: Live) -> Tensor:
        """silu(g) · u [R, N] bf16 (the dense layer's activation)."""

    def route_rows(self, x: Tensor, router_w: Tensor, top_k: int, live: Live
                   ) -> tuple[Tensor, Tensor]:
        """The router on x [R, H]: (weights [R, K] FP32 renormalized, ids [R, K] int32)."""


def make_ops(name: str, device, max_polls: int, pdl: bool = False) -> OpTable:
    table = {"kernels": KernelOps, "twins": TwinOps}
    if name not in table:
        raise ValueError(f"ops: unknown backend {name!r}; choose one of {sorted(table)}")
    if name == "kernels":
        return KernelOps(torch.device(device), max_polls, pdl=pdl)
    if pdl:
        raise ValueError("ops: pdl (programmatic dependent launch) needs the 'kernels' backend")
    return TwinOps(torch.device(device), max_polls)
