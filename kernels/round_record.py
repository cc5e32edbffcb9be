"""The round program's bookkeeping in two launches (twins: reference/twins/round_record.py):

check_logits  one program per (row, block of V columns): a live row's block holding NaN/±inf
              records the fault (code, round, where, 0). Several programs of one launch may
              record it; they write the same four values, and each first reads code 0 (no
              earlier fault — earlier launches are complete), so no atomics are needed.
record_draft  one program: depth j's draft from its sample (row 0), the token-range fault, the
              served row into q_ids[j] / q_probs[j], the clamped draft into drafts[j], n_d += one.

Each replaces the dozen-odd torch launches of its twin (elementwise ops, a stack, copies) inside
the captured round; both are integer / select logic and equal their twins bit for bit.

Dimension letters: R rows, V vocabulary, W served width, Db draft slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_tensor, live_count
from kernels.launch import launch_opts, pdl_enter
from kernels.twin import twin
from reference.op_types import DraftRecord, FaultLog, SampleOut
from reference.twins import round_record as _twins

BLOCK_V = 4096  # columns per check_logits program


@triton.jit
def _record_fault(fault_ptr, round_ptr, cond, code, where, value):
    """(code, round, where, value) into fault [4] when cond holds and fault[0] is 0."""
    first = cond & (tl.load(fault_ptr) == 0)
    i = tl.arange(0, 4)
    rnd = tl.load(round_ptr).to(tl.int64)
    val = tl.where(i == 0, code.to(tl.int64),
                   tl.where(i == 1, rnd, tl.where(i == 2, where.to(tl.int64),
                                                  value.to(tl.int64))))
    tl.store(fault_ptr + i, val, mask=(i < 4) & first)


@triton.jit
def _check_logits_kernel(x_ptr, n_ptr, fault_ptr, round_ptr, stride_x, V, code, where,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = row < tl.load(n_ptr)
    x = tl.load(x_ptr + row * stride_x + cols, mask=(cols < V) & live, other=0.0)
    x = x.to(tl.float32)
    bad = tl.sum(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=0) > 0
    zero = tl.full([], 0, tl.int64)
    _record_fault(fault_ptr, round_ptr, bad, zero + code, zero + where, zero)


@triton.jit
def _record_draft_kernel(tok_ptr, ids_ptr, probs_ptr, one_ptr, qi_ptr, qp_ptr, d_ptr, nd_ptr,
                         fault_ptr, round_ptr, stride_qi, stride_qp, j, vocab, code, W,
                         BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    one = tl.load(one_ptr)
    live = one > 0
    y = tl.where(live, tl.load(tok_ptr), 0).to(tl.int64)
    zero = tl.full([], 0, tl.int64)
    _record_fault(fault_ptr, round_ptr, live & ((y < 0) | (y >= vocab)), zero + code, zero + j,
                  y)
    y = tl.minimum(tl.maximum(y, 0), vocab - 1)
    w = tl.arange(0, BLOCK_W)
    wm = w < W
    ids = tl.load(ids_ptr + w, mask=wm, other=-1)
    probs = tl.load(probs_ptr + w, mask=wm, other=0.0)
    tl.store(qi_ptr + j * stride_qi + w, tl.where(live, ids, -1), mask=wm)
    tl.store(qp_ptr + j * stride_qp + w, tl.where(live, probs, 0.0), mask=wm)
    tl.store(d_ptr + j, y)
    tl.store(nd_ptr, tl.load(nd_ptr) + one)


def _check_log(log: FaultLog, dev) -> None:
    check_tensor("log.fault", log.fault, shape=(4,), dtypes=(torch.int64,), device=dev)
    check_tensor("log.round_no", log.round_no, shape=(1,), dtypes=(torch.int32,), device=dev)


def _check_int(name: str, v, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}), got {v!r}")


@twin(_twins.check_logits_ref)
def check_logits(
    logits: torch.Tensor,  # [R, V] fp32 | bf16, unit column stride
    n_live: torch.Tensor | None,  # device int32 [1]; None = all rows
    log: FaultLog,
    *,
    code: int,
    where: int,
    pdl: bool = False,
) -> None:
    """Record (code, round, where, 0) in log when a live row of logits holds NaN or ±inf and
    no fault came first."""
    dev = logits.device
    check_tensor("logits", logits, dims=2, dtypes=(torch.float32, torch.bfloat16), device=dev)
    rows, vocab = logits.shape
    if rows < 1 or vocab < 1 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected [R ≥ 1, V ≥ 1] with unit column stride, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    n = live_count(n_live, rows, dev)
    _check_log(log, dev)
    _check_int("code", code, 1, 2**31)
    _check_int("where", where, -(2**31), 2**31)
    _check_logits_kernel[(rows, triton.cdiv(vocab, BLOCK_V))](
        logits, n, log.fault, log.round_no, logits.stride(0), vocab, code, where,
        BLOCK=BLOCK_V, num_warps=4, **launch_opts(pdl))


@twin(_twins.record_draft_ref)
def record_draft(
    out: SampleOut,  # the depth's sample: tokens [R] int64, ids / probs [R, W] (row 0 read)
    one: torch.Tensor,  # [1] int32: 1 when depth j ran, else 0
    j: int,  # the depth, 0 … Db − 1
    rec: DraftRecord,
    log: FaultLog,
    *,
    vocab: int,
    code: int,
    pdl: bool = False,
) -> None:
    """As reference.twins.round_record.record_draft_ref, in one launch."""
    dev = one.device
    check_tensor("one", one, shape=(1,), dtypes=(torch.int32,), device=dev)
    db, width = rec.q_ids.shape if rec.q_ids.dim() == 2 else (0, 0)
    check_tensor("rec.q_ids", rec.q_ids, shape=(db, width), dtypes=(torch.int64,), device=dev)
    check_tensor("rec.q_probs", rec.q_probs, shape=(db, width), dtypes=(torch.float32,),
                 device=dev)
    check_tensor("rec.drafts", rec.drafts, shape=(db,), dtypes=(torch.int64,), device=dev)
    check_tensor("rec.n_d", rec.n_d, shape=(1,), dtypes=(torch.int32,), device=dev)
    check_tensor("out.tokens", out.tokens, dims=1, dtypes=(torch.int64,), device=dev)
    check_tensor("out.ids", out.ids, shape=(None, width), dtypes=(torch.int64,), device=dev)
    check_tensor("out.probs", out.probs, shape=(None, width), dtypes=(torch.float32,),
                 device=dev)
    for name, t in (("rec.q_ids", rec.q_ids), ("rec.q_probs", rec.q_probs),
                    ("out.ids", out.ids), ("out.probs", out.probs)):
        if width > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: expected unit column stride, got {t.stride()}")
    if rec.drafts.stride(0) != 1 and db > 1:
        raise ValueError(f"rec.drafts: expected unit stride, got {rec.drafts.stride()}")
    if out.tokens.shape[0] < 1 or out.ids.shape[0] < 1:
        raise ValueError("out: expected at least one row")
    _check_log(log, dev)
    _check_int("j", j, 0, max(db, 1))
    if db < 1:
        raise ValueError("rec: expected at least one draft slot")
    _check_int("vocab", vocab, 1, 2**62)
    _check_int("code", code, 1, 2**31)
    _record_draft_kernel[(1,)](
        out.tokens, out.ids, out.probs, one, rec.q_ids, rec.q_probs, rec.drafts, rec.n_d,
        log.fault, log.round_no, rec.q_ids.stride(0), rec.q_probs.stride(0), j, vocab, code,
        width, BLOCK_W=triton.next_power_of_2(max(width, 1)), num_warps=1, **launch_opts(pdl))
