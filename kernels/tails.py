"""Residual + RMSNorm tails of a layer ≥ 1 with the rank-partial sum read by NaN readiness
(kernels/readiness.py), and the router folded into the attention tail. Twins:
reference/twins/tails.py (`attn_tail_ref`, `moe_tail_ref`), which also lists the rounding points.

attention tail: one *row program* per buffer row r (grid slots 0..R−1): poll the N partials of row
  r, a = bf16(Σ), an, h32, h, f_in as in reference/model.py; with the router also the FP32 router
  input rms_norm(h32, ffn_norm) into a scratch row. Then *router programs* (slots R…), one per
  block of experts, each wait for those scratch rows inside this kernel — pinned: on a ready
  counter every row program raises after its store (TailLaunch.count_ready); otherwise by NaN
  readiness of the NaN-armed rows — compute FP32 logits for all live rows, and the last of them
  to finish (an acq_rel counter) does softmax → top-k → renormalize and publishes ids/weights
  (kernels/router.py). With TailLaunch.attn_chunk_groups a row program is K column-chunk
  programs (slots 0..R·K−1), the row's last arrival running the row on their staged a, and the
  router programs start at slot R·K (kernels/row_chunks.py).
  Scratch invariant between launches: both counters 0 (with NaN readiness also r_in all NaN) —
  the last router program restores it; launches of one stream never overlap, so the next launch
  starts from it.
  A router program only waits on row programs, which have the lowest program ids and are
  dispatched first, so they are resident before any router program spins (at the real shape
  R + E/block_e = 8 + 128 programs: more than the 132 SMs, not all co-resident at once — the
  rows are); the wait is bounded too (router_max_polls → failure flag), never a hang.
MoE tail: f = bf16(Σ), x = bf16(h + f·ffn_out_scale), xn' = bf16(rms_norm(x)). Pinned
  (TailLaunch.moe_chunk_groups): K column-chunk programs per row sum the partials, and the
  row's last arrival on a per-row counter runs the row on their staged f — the bits of one
  program per row for every K (kernels/row_chunks.py).

Row programs of padding rows (r ≥ n_live) poll row 0 instead of their own: they need the evidence
for re-arming (kernels/readiness.py (1)), not the data. Padding rows of h, f_in, x, xn', ids,
weights are never read or written; padding rows of the ring buffer are re-armed ((4) there).

Rounding by hand: the Triton interpreter's fp32→bf16 cast truncates, so kernels.fp8.bf16_rne
snaps to the bf16 grid first. rsqrt is 1/sqrt with IEEE div and sqrt (torch.rsqrt on the CPU is
exactly that); mean = sum / H with IEEE div. FMA contraction is off (enable_fp_fusion=False) so
xn + an·scale and h + f·scale round twice, as in torch. What remains vs the twin: the order of the
sum of squares in each norm and of the router GEMM, and exp in the softmax.

Launch configuration (warps, router blocks, the row programs' groups): kernels/tails_launch.py.

Dimension letters: N partials, R rows (≤ route_rows), H hidden, E experts, K top-k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_tensor, live_count
from kernels.fp8 import E4M3, bf16_rne, quantize_row
from kernels.launch import launch_opts, pdl_enter
from kernels.peer_partials import PartialsArg, partials_arg, span
from kernels.readiness import ready_row
from kernels.router import RouterScratch, _router_program
from kernels.row_chunks import MAX_CHUNKS, MAX_ROWS, RowChunkScratch, stage_row
from kernels.tails_launch import (
    TailLaunch,
    block_h,
    chunk_grid,
    groups,
    pow2,
    tail_launch,
    topk_mode,
)
from kernels.timeline import check_trace, stamp, stamp_start
from kernels.twin import twin
from reference.op_types import AttnTailOut, MoeTailOut
from reference.twins import tails as _twins

# a TP8 O-projection ring holds 8 ranks × S split-K partials (24 at the IQuest-Q1 rank shape,
# S = 3; found by `bench round --tp 2` on two H200s); the sum is unrolled, one load each
MAX_PARTIALS = 64
# TailLaunch.prefetch_w holds every chunk's [block_e, block_k] weight tile in registers
MAX_PREFETCH_CHUNKS = 4


@triton.jit
def _bf16(x):
    return bf16_rne(x).to(tl.float32)


@triton.jit
def _inv_rms(x, eps, HIDDEN: tl.constexpr):
    """1/sqrt(sum(x²)/H + eps) of a row x [BLOCK_H] (masked columns hold 0)."""
    ms = tl.div_rn(tl.sum(x * x, axis=0), tl.full([], HIDDEN, tl.float32))
    return tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(ms + eps))


@triton.jit
def _rms(x, w, eps, HIDDEN: tl.constexpr):
    """x · (1/sqrt(sum(x²)/H + eps)) · w, in that order (masked columns of x hold 0)."""
    return x * _inv_rms(x, eps, HIDDEN) * w


@triton.jit
def _attn_row_program(
    part_ptr, xn_ptr, w_aon_ptr, w_ffn_ptr, h_ptr, f_ptr, rearm_ptr, polls_ptr, flag_ptr, rin_ptr,
    q_ptr, s_ptr, ready_ptr, ok_ptr, arrive_ptr,
    stride_pn, stride_pr, stride_xr, stride_hr, stride_fr, stride_an, stride_ar, stride_qr,
    stride_sr, stride_ok, row, chunk, pid, n, eps, scale, max_polls,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, NPART: tl.constexpr, REARM: tl.constexpr,
    WRITE_POLLS: tl.constexpr, ROUTER: tl.constexpr, QUANT: tl.constexpr,
    GROUPS: tl.constexpr, TABLE: tl.constexpr, PART_BF16: tl.constexpr,
    REARM_PARTS: tl.constexpr, CHUNK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    trace_ptr, TRACE: tl.constexpr, COUNT_READY: tl.constexpr,
):
    """Row-chunk program (row, chunk). K = 1: the whole row (CHUNK = BLOCK_H). K > 1: each
    chunk stages a = bf16(Σ) of its columns in h's buffer, and the row's last arrival runs the
    row on the staged a (kernels/row_chunks.py); a padding row's chunk 0 raises the ready
    counter that its row program would."""
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    cmask = cols < HIDDEN
    acc, ready, live = ready_row(part_ptr, stride_pn, stride_pr, rearm_ptr, stride_an, stride_ar,
                                 polls_ptr, flag_ptr, row, n, cols, cmask, max_polls,
                                 NPART, REARM, WRITE_POLLS, TABLE, PART_BF16, REARM_PARTS)
    stamp(trace_ptr, pid, 1, TRACE)
    if K == 1:
        _attn_row(_bf16(acc), ready, live, xn_ptr, w_aon_ptr, w_ffn_ptr, h_ptr, f_ptr, rin_ptr,
                  q_ptr, s_ptr, ready_ptr, stride_xr, stride_hr, stride_fr, stride_qr, stride_sr,
                  row, cols, cmask & live, eps, scale, HIDDEN, ROUTER, QUANT, GROUPS,
                  trace_ptr, pid, TRACE, COUNT_READY)
    elif live:  # the row's chunks stage a in h's buffer; the last arrival runs the row
        last, a, ok = stage_row(h_ptr, stride_hr, ok_ptr, arrive_ptr, stride_ok, row, chunk,
                                cols, cmask, acc, ready, HIDDEN, BLOCK_H, K, KP)
        if last:
            every = tl.arange(0, BLOCK_H)
            _attn_row(a, ok, live, xn_ptr, w_aon_ptr, w_ffn_ptr, h_ptr, f_ptr, rin_ptr, q_ptr,
                      s_ptr, ready_ptr, stride_xr, stride_hr, stride_fr, stride_qr, stride_sr,
                      row, every, every < HIDDEN, eps, scale, HIDDEN, ROUTER, QUANT, GROUPS,
                      trace_ptr, pid, TRACE, COUNT_READY)
    elif ROUTER and COUNT_READY and chunk == 0:
        tl.atomic_add(ready_ptr, 1, sem="release", scope="gpu")
    stamp(trace_ptr, pid, 3, TRACE)


@triton.jit
def _attn_row(a, ready, live, xn_ptr, w_aon_ptr, w_ffn_ptr, h_ptr, f_ptr, rin_ptr, q_ptr, s_ptr,
              ready_ptr, stride_xr, stride_hr, stride_fr, stride_qr, stride_sr, row, cols, m,
              eps, scale, HIDDEN: tl.constexpr, ROUTER: tl.constexpr, QUANT: tl.constexpr,
              GROUPS: tl.constexpr, trace_ptr, pid, TRACE: tl.constexpr,
              COUNT_READY: tl.constexpr):
    """A whole row from the o_proj output a [BLOCK_H] (bf16 values): h, f_in (NaN unless
    ready), the router input and the ready counter, then the experts' gate/up operand."""
    w_aon = tl.load(w_aon_ptr + cols, mask=m, other=0.0).to(tl.float32)
    w_ffn = tl.load(w_ffn_ptr + cols, mask=m, other=0.0).to(tl.float32)
    an = _bf16(_rms(a, w_aon, eps, HIDDEN))
    xn = tl.load(xn_ptr + row * stride_xr + cols, mask=m, other=0.0).to(tl.float32)
    h32 = xn + an * scale
    h = _bf16(h32)
    f = _bf16(_rms(h, w_ffn, eps, HIDDEN))
    h = tl.where(ready != 0, h, float("nan"))
    f = tl.where(ready != 0, f, float("nan"))
    tl.store(h_ptr + row * stride_hr + cols, h.to(tl.bfloat16), mask=m)
    tl.store(f_ptr + row * stride_fr + cols, f.to(tl.bfloat16), mask=m)
    if ROUTER:
        # un-rounded FP32 router input; +inf on failure so router programs do not wait for it
        r_in = tl.where(ready != 0, _rms(h32, w_ffn, eps, HIDDEN), float("inf"))
        tl.store(rin_ptr + row * HIDDEN + cols, r_in, mask=m)
        if COUNT_READY:  # every row counts, padding rows too (nothing to store)
            tl.debug_barrier()  # release: every thread's r_in stored before the counter moves
            tl.atomic_add(ready_ptr, 1, sem="release", scope="gpu")
    stamp(trace_ptr, pid, 2, TRACE)
    if QUANT:  # the experts' gate/up operand, after r_in: the router programs wait for r_in only
        quantize_row(f, q_ptr, s_ptr, row, live, HIDDEN, stride_qr, stride_sr, GROUPS)


@triton.jit
def _attn_tail_kernel(
    part_ptr, xn_ptr, w_aon_ptr, w_ffn_ptr, h_ptr, f_ptr, rearm_ptr, polls_ptr, flag_ptr,
    n_live_ptr, rin_ptr, rw_ptr, logit_ptr, cnt_ptr, ids_ptr, wts_ptr, q_ptr, s_ptr,
    ok_ptr, arrive_ptr,
    stride_pn, stride_pr, stride_xr, stride_hr, stride_fr, stride_an, stride_ar,
    stride_ir, stride_ik, stride_wr, stride_wk, stride_qr, stride_sr, stride_ok,
    ROWS, eps, scale, max_polls, router_polls,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, NPART: tl.constexpr, REARM: tl.constexpr,
    WRITE_POLLS: tl.constexpr, ROUTER: tl.constexpr, EXPERTS: tl.constexpr,
    BLOCK_EALL: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr,
    ROUTE_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    UNROLL_K: tl.constexpr, QUANT: tl.constexpr, GROUPS: tl.constexpr,
    TABLE: tl.constexpr, PART_BF16: tl.constexpr, REARM_PARTS: tl.constexpr,
    CHUNK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    TOPK: tl.constexpr, PREFETCH_W: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
    ready_ptr, COUNT_READY: tl.constexpr, PDL: tl.constexpr,
):
    """Programs 0 … ROWS·K − 1: row chunks (row = pid // K); the rest: router programs."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    stamp_start(trace_ptr, pid, TRACE)
    n = tl.load(n_live_ptr)
    if pid < ROWS * K:
        _attn_row_program(part_ptr, xn_ptr, w_aon_ptr, w_ffn_ptr, h_ptr, f_ptr, rearm_ptr,
                          polls_ptr, flag_ptr, rin_ptr, q_ptr, s_ptr, ready_ptr, ok_ptr,
                          arrive_ptr, stride_pn, stride_pr, stride_xr, stride_hr, stride_fr,
                          stride_an, stride_ar, stride_qr, stride_sr, stride_ok, pid // K,
                          pid % K, pid, n, eps, scale, max_polls,
                          HIDDEN, BLOCK_H, NPART, REARM, WRITE_POLLS, ROUTER, QUANT, GROUPS,
                          TABLE, PART_BF16, REARM_PARTS, CHUNK, K, KP, trace_ptr, TRACE,
                          COUNT_READY)
    elif ROUTER:
        _router_program(rin_ptr, rw_ptr, logit_ptr, cnt_ptr, ids_ptr, wts_ptr, flag_ptr,
                        stride_ir, stride_ik, stride_wr, stride_wk,
                        pid - ROWS * K, tl.num_programs(0) - ROWS * K, n, router_polls,
                        ready_ptr, ROWS,
                        HIDDEN, EXPERTS, BLOCK_EALL, TOP_K, BLOCK_TOPK, ROUTE_ROWS, BLOCK_E,
                        BLOCK_K, UNROLL_K, TOPK, PREFETCH_W, trace_ptr, pid, TRACE,
                        COUNT_READY)


@triton.jit
def _moe_tail_kernel(
    part_ptr, h_ptr, w_ptr, xn_ptr, x_ptr, rearm_ptr, polls_ptr, flag_ptr, n_live_ptr,
    q_ptr, s_ptr, ok_ptr, arrive_ptr,
    stride_pn, stride_pr, stride_hr, stride_xnr, stride_xr, stride_an, stride_ar, stride_qr,
    stride_sr, stride_ok, eps, scale, max_polls,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, NPART: tl.constexpr, REARM: tl.constexpr,
    WRITE_POLLS: tl.constexpr, WRITE_X: tl.constexpr, QUANT: tl.constexpr,
    GROUPS: tl.constexpr, TABLE: tl.constexpr, PART_BF16: tl.constexpr,
    REARM_PARTS: tl.constexpr, CHUNK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    trace_ptr, TRACE: tl.constexpr, RELEASE: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, chunk) of a grid [R, K]. K = 1: the whole row (CHUNK = BLOCK_H). K > 1:
    each chunk stages f = bf16(Σ) of its columns in x's buffer, and the row's last arrival runs
    the row on the staged f (kernels/row_chunks.py). RELEASE (TailLaunch.moe_release): the next
    launch may start now."""
    pdl_enter(PDL, RELEASE)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    pid = row * K + chunk
    stamp_start(trace_ptr, pid, TRACE)
    n = tl.load(n_live_ptr)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    cmask = cols < HIDDEN
    acc, ready, live = ready_row(part_ptr, stride_pn, stride_pr, rearm_ptr, stride_an, stride_ar,
                                 polls_ptr, flag_ptr, row, n, cols, cmask, max_polls,
                                 NPART, REARM, WRITE_POLLS, TABLE, PART_BF16, REARM_PARTS)
    stamp(trace_ptr, pid, 1, TRACE)
    if K == 1:
        _moe_tail_row(_bf16(acc), ready, live, h_ptr, w_ptr, xn_ptr, x_ptr, q_ptr, s_ptr, row,
                      cols, cmask & live, stride_hr, stride_xnr, stride_xr, stride_qr, stride_sr,
                      eps, scale, HIDDEN, WRITE_X, QUANT, GROUPS, trace_ptr, pid, TRACE)
    elif live:  # the row's chunks stage f in x's buffer; the last arrival runs the row
        last, f, ok = stage_row(x_ptr, stride_xr, ok_ptr, arrive_ptr, stride_ok, row, chunk,
                                cols, cmask, acc, ready, HIDDEN, BLOCK_H, K, KP)
        if last:
            every = tl.arange(0, BLOCK_H)
            _moe_tail_row(f, ok, live, h_ptr, w_ptr, xn_ptr, x_ptr, q_ptr, s_ptr, row, every,
                          every < HIDDEN, stride_hr, stride_xnr, stride_xr, stride_qr, stride_sr,
                          eps, scale, HIDDEN, WRITE_X, QUANT, GROUPS, trace_ptr, pid, TRACE)
    stamp(trace_ptr, pid, 3, TRACE)


@triton.jit
def _moe_tail_row(f, ready, live, h_ptr, w_ptr, xn_ptr, x_ptr, q_ptr, s_ptr, row, cols, m,
                  stride_hr, stride_xnr, stride_xr, stride_qr, stride_sr, eps, scale,
                  HIDDEN: tl.constexpr, WRITE_X: tl.constexpr, QUANT: tl.constexpr,
                  GROUPS: tl.constexpr, trace_ptr, pid, TRACE: tl.constexpr):
    """A whole row from the experts' output f [BLOCK_H] (bf16 values): x, xn' (NaN unless
    ready), then the next layer's QKV operand."""
    h = tl.load(h_ptr + row * stride_hr + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    x = _bf16(h + f * scale)
    xn = _bf16(_rms(x, w, eps, HIDDEN))
    xn = tl.where(ready != 0, xn, float("nan"))
    tl.store(xn_ptr + row * stride_xnr + cols, xn.to(tl.bfloat16), mask=m)
    if WRITE_X:
        x = tl.where(ready != 0, x, float("nan"))
        tl.store(x_ptr + row * stride_xr + cols, x.to(tl.bfloat16), mask=m)
    stamp(trace_ptr, pid, 2, TRACE)
    if QUANT:  # the next layer's QKV operand
        quantize_row(xn, q_ptr, s_ptr, row, live, HIDDEN, stride_qr, stride_sr, GROUPS)


# --- wrappers ----------------------------------------------------------------------------------


def _check_rows(name: str, t, rows: int, hidden: int, dtypes, device) -> None:
    check_tensor(name, t, shape=(rows, hidden), dtypes=dtypes, device=device)
    if t.stride(1) != 1:
        raise ValueError(f"{name}: expected unit column stride, got strides {t.stride()}")


def _quant_outputs(q, s, quantize: bool, rows: int, hidden: int, dev, what: str):
    """(q [R, H] E4M3, s [R, ⌈H/128⌉] fp32), allocated when None; None, None without quantize."""
    if not quantize:
        return None, None
    groups = -(-hidden // 128)
    q = torch.empty(rows, hidden, dtype=E4M3, device=dev) if q is None else q
    s = torch.empty(rows, groups, dtype=torch.float32, device=dev) if s is None else s
    _check_rows(f"out.{what}q", q, rows, hidden, (E4M3,), dev)
    _check_rows(f"out.s{what}", s, rows, groups, (torch.float32,), dev)
    return q, s


def _check_common(p: PartialsArg, n_live, fail_flag, max_polls, rearm, polls, cfg):
    npart, rows, hidden = p.shape
    dev = p.device
    if not 1 <= npart <= MAX_PARTIALS:
        raise ValueError(f"partials: expected 1..{MAX_PARTIALS} partials (dim 0), got {npart}")
    if not 1 <= rows <= cfg.route_rows:
        raise ValueError(f"partials: expected 1..{cfg.route_rows} rows (dim 1), got {rows}")
    if hidden < 1 or (not p.table and p.arg.stride(2) != 1):
        raise ValueError(f"partials: expected H >= 1 with unit stride, got shape "
                         f"{tuple(p.shape)} strides {p.arg.stride()}")
    n = live_count(n_live, rows, dev)
    check_tensor("fail_flag", fail_flag, shape=(1,), dtypes=(torch.int32,), device=dev)
    if not isinstance(max_polls, int) or not 1 <= max_polls < 2**31:
        raise ValueError(f"max_polls: expected an int in [1, 2^31), got {max_polls!r}")
    if rearm is not None:
        if not isinstance(rearm, torch.Tensor) or rearm.dim() not in (2, 3):
            raise ValueError(f"rearm: expected a tensor [R, H] or [S, R, H], got "
                             f"{getattr(rearm, 'shape', type(rearm).__name__)}")
        for i, part in enumerate(rearm if rearm.dim() == 3 else rearm[None]):
            _check_rows(f"rearm[{i}]" if rearm.dim() == 3 else "rearm", part, rows, hidden,
                        (p.dtype,), dev)
        a0, a1 = span(rearm)
        if any(a0 < b1 and b0 < a1 for b0, b1 in p.spans):
            raise ValueError("rearm: overlaps the partials being consumed; a consumer re-arms "
                             "an older slot, never the one it reads (kernels/readiness.py (1))")
    if polls is not None:
        check_tensor("polls", polls, shape=(rows,), dtypes=(torch.int32,), device=dev)
    return npart, rows, hidden, n


def _rearm_args(rearm, dummy) -> tuple:
    """→ (pointer arg, part stride, row stride, parts) of an [R, H] / [S, R, H] re-arm target."""
    if rearm is None:
        return dummy, 0, 0, 1
    parts = rearm if rearm.dim() == 3 else rearm[None]
    return rearm, parts.stride(0), parts.stride(1), parts.shape[0]


def _chunk_args(groups: int, hidden: int, rows: int, scratch: RowChunkScratch | None, dev,
                dummy: torch.Tensor) -> tuple[int, int, RowChunkScratch]:
    """→ (columns per row-chunk program, programs per row K, the scratch its counters use — a
    checked one, a fresh one when None, or placeholders when K = 1)."""
    chunk, k = chunk_grid(groups, hidden)
    if k == 1:
        return chunk, k, RowChunkScratch(dummy, dummy)
    if k > MAX_CHUNKS or rows > MAX_ROWS:
        raise ValueError(f"config: chunks of {groups} groups make {k} chunks of {rows} rows; at "
                         f"most {MAX_CHUNKS} chunks and {MAX_ROWS} rows")
    scratch = RowChunkScratch.create(dev) if scratch is None else scratch
    check_tensor("chunk_scratch.arrive", scratch.arrive, shape=(MAX_ROWS,), dtypes=(torch.int32,),
                 device=dev)
    check_tensor("chunk_scratch.ok", scratch.ok, shape=(MAX_ROWS, MAX_CHUNKS),
                 dtypes=(torch.int32,), device=dev)
    if not (scratch.arrive.is_contiguous() and scratch.ok.is_contiguous()):
        raise ValueError("chunk_scratch: arrive and ok must be contiguous")
    return chunk, k, scratch


@twin(_twins.attn_tail_ref)
def attn_tail(
    partials,  # [N, R, H] fp32 | bf16 o_proj partials (a ring slot) or PeerPartials; NaN: unwritten
    xn: torch.Tensor,  # [R, H] bf16 this layer's normalized input
    attn_out_norm: torch.Tensor,  # [H] bf16 | fp32
    ffn_norm: torch.Tensor,  # [H] bf16 | fp32 feed_forward_norm
    n_live: torch.Tensor | None,  # device int32 [1], 1..R; None = all rows
    fail_flag: torch.Tensor,  # device int32 [1]; set to 1 on a readiness timeout, never cleared
    *,
    eps: float,
    attn_out_scale: float,
    max_polls: int,
    rearm: torch.Tensor | None = None,  # [R, H] | [S, R, H] own buffer(s) of step t − lag
    #                                     (kernels/readiness.py)
    router_w: torch.Tensor | None = None,  # [E, H] fp32, contiguous
    top_k: int = 0,
    scratch: RouterScratch | None = None,
    out: AttnTailOut | None = None,
    polls: torch.Tensor | None = None,  # [R] int32: polls each row program made
    config: TailLaunch | None = None,
    router_max_polls: int = 1 << 20,
    quantize: bool = False,
    pdl: bool = False,
    trace: torch.Tensor | None = None,  # [R·K + router programs, SLOTS] int64 (kernels/timeline)
    chunk_scratch: RowChunkScratch | None = None,  # with config.attn_chunk_groups; None: fresh
) -> AttnTailOut:
    """Attention tail of a layer ≥ 1 (+ the folded router when router_w is given); outputs as
    reference.twins.tails.attn_tail_ref, padding rows untouched.

    max_polls bounds the wait for the producers of the partials (other ranks, earlier
    kernels). router_max_polls bounds the router programs' wait for this kernel's own row
    programs, which run concurrently on a GPU and need a few µs: with a bound as small as
    max_polls may be, the router would time out while the rows are still computing (seen on
    the H200 with max_polls = 4). It is still finite: a row program that never finishes ends
    in the failure flag, not a hang.
    quantize: also out.fq / out.sf = kernels.fp8.quantize_act(f_in) bit for bit (the experts'
    gate/up operand, so that moe_fp8 needs no quantization launch).
    pdl: programmatic dependent launch (kernels/launch.py).
    config.attn_chunk_groups: K column-chunk programs per row (kernels/row_chunks.py; grid
    slots 0..R·K−1, row = slot // K), the same bits as one per row; their counters live in
    `chunk_scratch` (a fresh one costs a fill launch).
    trace (CUDA only): per-program timestamps, slots 0 start; row programs (at row·K + chunk)
    1 partials summed, 2 h / f_in / router input stored (the row's last chunk), 3 end; router
    programs 1 logits computed, 2 arrived on
    the counter, 3 (the last) routed, 8 its input seen (the wait over); the last also 4
    softmax, 5 top-k, 6 ids / weights stored (kernels/router.py _route_finish)."""
    p = partials_arg(partials)
    if router_w is not None:
        check_tensor("router_w", router_w, dims=2, dtypes=(torch.float32,), device=p.device)
    cfg = config or tail_launch(p.shape[-1], 0 if router_w is None else router_w.shape[0])
    npart, rows, hidden, n = _check_common(p, n_live, fail_flag, max_polls, rearm, polls, cfg)
    dev = p.device
    _check_rows("xn", xn, rows, hidden, (torch.bfloat16,), dev)
    for name, w in (("attn_out_norm", attn_out_norm), ("ffn_norm", ffn_norm)):
        check_tensor(name, w, shape=(hidden,), dtypes=(torch.bfloat16, torch.float32), device=dev)
        if w.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous vector")
    router = router_w is not None
    experts = 0
    if router:
        experts = router_w.shape[0]
        if router_w.shape[1] != hidden or not router_w.is_contiguous():
            raise ValueError(f"router_w: expected contiguous [E, {hidden}], got shape "
                             f"{tuple(router_w.shape)} strides {router_w.stride()}")
        if not 1 <= top_k <= min(experts, 16):
            raise ValueError(f"top_k: expected 1..{min(experts, 16)}, got {top_k}")
        if scratch is None:
            scratch = RouterScratch.create(hidden, experts, dev, cfg.route_rows)
        check_tensor("scratch.r_in", scratch.r_in, shape=(cfg.route_rows, hidden),
                     dtypes=(torch.float32,), device=dev)
        check_tensor("scratch.logits", scratch.logits, shape=(cfg.route_rows, experts),
                     dtypes=(torch.float32,), device=dev)
        for name in ("counter", "ready"):
            check_tensor(f"scratch.{name}", getattr(scratch, name), shape=(1,),
                         dtypes=(torch.int32,), device=dev)
        if not (scratch.r_in.is_contiguous() and scratch.logits.is_contiguous()):
            raise ValueError("scratch: r_in and logits must be contiguous")
    elif top_k or scratch is not None:
        raise ValueError("top_k / scratch given without router_w")
    if router and cfg.prefetch_w and -(-hidden // cfg.block_k) > MAX_PREFETCH_CHUNKS:
        raise ValueError(f"config.prefetch_w: needs at most {MAX_PREFETCH_CHUNKS} chunks of "
                         f"block_k {cfg.block_k} over H {hidden}")
    if not isinstance(router_max_polls, int) or not 1 <= router_max_polls < 2**31:
        raise ValueError(
            f"router_max_polls: expected an int in [1, 2^31), got {router_max_polls!r}"
        )
    if out is None:
        out = AttnTailOut(torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev),
                          torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev))
    _check_rows("out.h", out.h, rows, hidden, (torch.bfloat16,), dev)
    _check_rows("out.f_in", out.f_in, rows, hidden, (torch.bfloat16,), dev)
    if router:
        if out.ids is None:
            out.ids = torch.empty(rows, top_k, dtype=torch.int32, device=dev)
        if out.weights is None:
            out.weights = torch.empty(rows, top_k, dtype=torch.float32, device=dev)
        check_tensor("out.ids", out.ids, shape=(rows, top_k), dtypes=(torch.int32,), device=dev)
        check_tensor("out.weights", out.weights, shape=(rows, top_k), dtypes=(torch.float32,),
                     device=dev)
    dummy = out.h
    out.fq, out.sf = _quant_outputs(out.fq, out.sf, quantize, rows, hidden, dev, "f")
    q, s = (out.fq, out.sf) if quantize else (dummy, dummy)
    ids, wts = (out.ids, out.weights) if router else (dummy, dummy)
    sc = scratch if router else RouterScratch(dummy, dummy, fail_flag, fail_flag)
    n_route = triton.cdiv(experts, cfg.block_e) if router else 0
    re_ptr, stride_an, stride_ar, re_parts = _rearm_args(rearm, dummy)
    chunk, k, rc = _chunk_args(cfg.attn_chunk_groups, hidden, rows, chunk_scratch, dev, fail_flag)
    if trace is not None:
        check_trace(trace, rows * k + n_route, dev)
    _attn_tail_kernel[(rows * k + n_route,)](
        p.arg, xn, attn_out_norm, ffn_norm, out.h, out.f_in,
        re_ptr, dummy if polls is None else polls, fail_flag, n,
        sc.r_in, dummy if router_w is None else router_w, sc.logits, sc.counter, ids, wts, q, s,
        rc.ok, rc.arrive,
        p.stride_n, p.stride_r, xn.stride(0), out.h.stride(0),
        out.f_in.stride(0), stride_an, stride_ar,
        ids.stride(0), ids.stride(1), wts.stride(0), wts.stride(1), q.stride(0), s.stride(0),
        rc.ok.stride(0), rows, eps, attn_out_scale, max_polls, router_max_polls,
        HIDDEN=hidden, BLOCK_H=block_h(hidden), NPART=npart, REARM=rearm is not None,
        WRITE_POLLS=polls is not None, ROUTER=router, EXPERTS=max(experts, 1),
        BLOCK_EALL=pow2(max(experts, 1)), TOP_K=max(top_k, 1), BLOCK_TOPK=pow2(max(top_k, 1)),
        ROUTE_ROWS=cfg.route_rows, BLOCK_E=cfg.block_e, BLOCK_K=cfg.block_k,
        UNROLL_K=cfg.unroll_k, QUANT=quantize, GROUPS=groups(hidden),
        TABLE=p.table, PART_BF16=p.dtype == torch.bfloat16, REARM_PARTS=re_parts,
        CHUNK=chunk, K=k, KP=pow2(k), TOPK=topk_mode(cfg), PREFETCH_W=cfg.prefetch_w,
        trace_ptr=dummy if trace is None else trace, TRACE=trace is not None,
        ready_ptr=sc.ready, COUNT_READY=router and cfg.count_ready,
        num_warps=cfg.num_warps,
        **launch_opts(pdl, enable_fp_fusion=False),
    )
    return out


@twin(_twins.moe_tail_ref)
def moe_tail(
    partials,  # [N, R, H] fp32 | bf16 expert-output partials, or PeerPartials; NaN = unwritten
    h: torch.Tensor,  # [R, H] bf16 residual from the attention tail
    next_norm: torch.Tensor,  # [H] next layer's attention_norm, or the final norm
    n_live: torch.Tensor | None,
    fail_flag: torch.Tensor,
    *,
    eps: float,
    ffn_out_scale: float,
    max_polls: int,
    rearm: torch.Tensor | None = None,
    out: MoeTailOut | None = None,  # out.x None: the layer output x is not written
    polls: torch.Tensor | None = None,
    config: TailLaunch | None = None,
    quantize: bool = False,
    pdl: bool = False,
    trace: torch.Tensor | None = None,  # [R·K, SLOTS] int64 (kernels/timeline.py)
    chunk_scratch: RowChunkScratch | None = None,  # with config.moe_chunk_groups; None: fresh
) -> MoeTailOut:
    """MoE tail of a layer ≥ 1; outputs as reference.twins.tails.moe_tail_ref, padding rows
    untouched. quantize: also out.xq / out.sx = kernels.fp8.quantize_act(xn) bit for bit (the next
    layer's QKV operand, so that its GEMM needs no quantization launch).
    pdl: programmatic dependent launch (kernels/launch.py).
    config.moe_chunk_groups: K column-chunk programs per row (kernels/row_chunks.py), the same
    bits as one per row; their counters live in `chunk_scratch` (a fresh one costs a fill
    launch: pass one that lives as long as the caller, as iquestrt/ops_kernels.py does).
    trace (CUDA only): per-program timestamps at row·K + chunk, slots 0 start, 1 partials summed,
    2 xn / x stored (the row's last chunk), 3 end."""
    p = partials_arg(partials)
    cfg = config or tail_launch(p.shape[-1])
    if cfg.moe_release and not pdl:
        raise ValueError("TailLaunch.moe_release: releases the next launch early through "
                         "programmatic dependent launch; needs pdl=True")
    npart, rows, hidden, n = _check_common(p, n_live, fail_flag, max_polls, rearm, polls, cfg)
    dev = p.device
    _check_rows("h", h, rows, hidden, (torch.bfloat16,), dev)
    check_tensor("next_norm", next_norm, shape=(hidden,), dtypes=(torch.bfloat16, torch.float32),
                 device=dev)
    if next_norm.stride(0) != 1:
        raise ValueError("next_norm: expected a contiguous vector")
    if out is None:
        out = MoeTailOut(torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev))
    _check_rows("out.xn", out.xn, rows, hidden, (torch.bfloat16,), dev)
    if out.x is not None:
        _check_rows("out.x", out.x, rows, hidden, (torch.bfloat16,), dev)
    x = out.xn if out.x is None else out.x
    out.xq, out.sx = _quant_outputs(out.xq, out.sx, quantize, rows, hidden, dev, "x")
    q, s = (out.xq, out.sx) if quantize else (out.xn, out.xn)
    re_ptr, stride_an, stride_ar, re_parts = _rearm_args(rearm, out.xn)
    chunk, k, sc = _chunk_args(cfg.moe_chunk_groups, hidden, rows, chunk_scratch, dev, fail_flag)
    if trace is not None:
        check_trace(trace, rows * k, dev)
    _moe_tail_kernel[(rows, k)](
        p.arg, h, next_norm, out.xn, x, re_ptr,
        out.xn if polls is None else polls, fail_flag, n, q, s, sc.ok, sc.arrive,
        p.stride_n, p.stride_r, h.stride(0), out.xn.stride(0), x.stride(0),
        stride_an, stride_ar, q.stride(0), s.stride(0), sc.ok.stride(0),
        eps, ffn_out_scale, max_polls,
        HIDDEN=hidden, BLOCK_H=block_h(hidden), NPART=npart, REARM=rearm is not None,
        WRITE_POLLS=polls is not None, WRITE_X=out.x is not None, QUANT=quantize,
        GROUPS=groups(hidden), TABLE=p.table, PART_BF16=p.dtype == torch.bfloat16,
        REARM_PARTS=re_parts, CHUNK=chunk, K=k, KP=pow2(k),
        trace_ptr=out.xn if trace is None else trace,
        TRACE=trace is not None, RELEASE=cfg.moe_release, num_warps=cfg.num_warps,
        **launch_opts(pdl, enable_fp_fusion=False),
    )
    return out
