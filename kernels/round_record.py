"""The round program's bookkeeping in four kernels (twins: reference/twins/round_record.py):

check_flags   one program: the readiness fault (code, round, first raised layer flag, 0).
check_logits  one program per (row, block of V columns): a live row's block holding NaN/±inf
              records the fault (code, round, where, 0). Several programs of one launch may
              record it; they write the same four values, and each first reads code 0 (no
              earlier fault — earlier launches are complete), so no atomics are needed.
record_draft  one program: depth j's draft from its sample (row 0), the token-range fault, the
              served row into q_ids[j] / q_probs[j], the clamped draft into drafts[j], n_d += one.
settle_round  one program: the state and log after verification (the next token's fault, the
              emitted tokens, the hidden rows, the log row, m / n_new / round / done). Every
              value is read before any is written except the fault, whose new state is carried
              in registers (a program's stores and later loads of one address may be different
              threads': no reload).

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
from reference.op_types import DraftRecord, FaultLog, RoundState, SampleOut, VerifyOut
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
def _check_flags_kernel(flags_ptr, ran_ptr, fault_ptr, round_ptr, L, code,
                        BLOCK_L: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    i = tl.arange(0, BLOCK_L)
    raised = tl.load(flags_ptr + i, mask=i < L, other=0) != 0
    first = tl.min(tl.where(raised, i, BLOCK_L), axis=0)  # the first raised flag
    bad = (first < BLOCK_L) & (tl.load(ran_ptr) > 0)
    zero = tl.full([], 0, tl.int64)
    _record_fault(fault_ptr, round_ptr, bad, zero + code, zero + first, zero)


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


@triton.jit
def _settle_kernel(
    acc_ptr, next_ptr, bonus_ptr, vem_ptr, keepd_ptr, hid_ptr, nd_ptr, d_ptr, qi_ptr, qp_ptr,
    tok_ptr, stop_ptr, m_ptr, dn_ptr, sh_ptr, hat_ptr, nnew_ptr, maxnew_ptr, done_ptr, round_ptr,
    fault_ptr, head_ptr, lem_ptr, ldr_ptr, lqi_ptr, lqp_ptr,
    stride_hid, stride_sh, R, S, N_VEM, DB, DBW, dump_slot, dump_row, vocab, code,
    H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HC: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_DB: tl.constexpr, BLOCK_DBW: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    done = tl.load(done_ptr)
    go = 1 - done
    live = go > 0
    m = tl.load(m_ptr)
    a = tl.load(acc_ptr) * go
    rnd = tl.load(round_ptr)
    # the next token's fault; `faulted` is the fault state after it, kept in registers
    nxt_tok = tl.load(next_ptr)
    zero = tl.full([], 0, tl.int64)
    f0 = tl.load(fault_ptr)
    bad = live & ((nxt_tok < 0) | (nxt_tok >= vocab))
    _record_fault(fault_ptr, round_ptr, bad, zero + code, zero - 1, nxt_tok)
    faulted = (f0 != 0) | bad
    n_em = (a + 1) * go
    tl.store(dn_ptr, tl.load(keepd_ptr), mask=live)
    tl.store(hat_ptr, m, mask=live)
    r = tl.arange(0, BLOCK_R)
    rm = r < R
    for h0 in range(0, H, BLOCK_HC):  # hidden rows: moved bits
        c = h0 + tl.arange(0, BLOCK_HC)
        msk = rm[:, None] & (c < H)[None, :]
        x = tl.load(hid_ptr + r[:, None] * stride_hid + c[None, :], mask=msk & live)
        tl.store(sh_ptr + r[:, None] * stride_sh + c[None, :], x, mask=msk & live)
    em_live = rm & (r < n_em)
    em = tl.load(vem_ptr + r, mask=rm & (r < N_VEM), other=-1)
    em = tl.where(em_live, em, -1)
    slot = tl.where(em_live, (m + 1 + r).to(tl.int64), dump_slot)
    tl.store(tok_ptr + slot, em, mask=rm)  # the dump slot takes −1 from each dead row
    si = tl.arange(0, BLOCK_S)
    stops = tl.load(stop_ptr + si, mask=si < S, other=-2)  # −2: never a token
    hit = (em[:, None] == stops[None, :]) & (si < S)[None, :] & em_live[:, None]
    hit_stop = tl.sum(tl.sum(hit.to(tl.int32), axis=1), axis=0) > 0
    n_new = tl.load(nnew_ptr) + n_em
    finished = live & (hit_stop | (n_new >= tl.load(maxnew_ptr)) | faulted)
    row = tl.where(live, rnd, dump_row).to(tl.int64)
    k = tl.arange(0, 8)
    head = tl.where(k == 0, m, tl.where(k == 1, a, tl.where(
        k == 2, tl.load(bonus_ptr), tl.where(k == 3, tl.load(nd_ptr), n_em))))
    tl.store(head_ptr + row * 5 + k, head, mask=k < 5)
    tl.store(lem_ptr + row * R + r, em, mask=rm)
    di = tl.arange(0, BLOCK_DB)
    tl.store(ldr_ptr + row * DB + di, tl.load(d_ptr + di, mask=di < DB), mask=di < DB)
    qi = tl.arange(0, BLOCK_DBW)
    qm = qi < DBW
    tl.store(lqi_ptr + row * DBW + qi, tl.load(qi_ptr + qi, mask=qm), mask=qm)
    tl.store(lqp_ptr + row * DBW + qi, tl.load(qp_ptr + qi, mask=qm), mask=qm)
    tl.store(m_ptr, m + n_em)
    tl.store(nnew_ptr, n_new)
    tl.store(round_ptr, rnd + go)
    tl.store(done_ptr, tl.where(finished | faulted, 1, done))


def _check_log(log: FaultLog, dev) -> None:
    check_tensor("log.fault", log.fault, shape=(4,), dtypes=(torch.int64,), device=dev)
    check_tensor("log.round_no", log.round_no, shape=(1,), dtypes=(torch.int32,), device=dev)


def _check_int(name: str, v, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}), got {v!r}")


@twin(_twins.check_flags_ref)
def check_flags(
    flags: torch.Tensor,  # [L] int32 readiness flags, one per layer
    ran: torch.Tensor,  # [1] int32: > 0 when the round ran
    log: FaultLog,
    *,
    code: int,
    pdl: bool = False,
) -> None:
    """Record (code, round, index of the first raised flag, 0) in log when a flag is raised,
    the round ran and no fault came first."""
    dev = flags.device
    check_tensor("flags", flags, dims=1, dtypes=(torch.int32,), device=dev)
    if flags.shape[0] < 1 or flags.stride(0) != 1:
        raise ValueError(f"flags: expected [L ≥ 1] contiguous, got shape {tuple(flags.shape)}")
    check_tensor("ran", ran, shape=(1,), dtypes=(torch.int32,), device=dev)
    _check_log(log, dev)
    _check_int("code", code, 1, 2**31)
    _check_flags_kernel[(1,)](flags, ran, log.fault, log.round_no, flags.shape[0], code,
                              BLOCK_L=triton.next_power_of_2(flags.shape[0]), num_warps=1,
                              **launch_opts(pdl))


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


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


@twin(_twins.settle_round_ref)
def settle_round(
    v: VerifyOut,  # n_accepted [1] int32, next_token [1] int64, bonus [1] int32, emitted [≥1]
    keep_d: torch.Tensor,  # [1] int32 the draft cache's next position after the settlement
    hidden: torch.Tensor,  # [R, H] bf16 the target's final hidden rows of this round
    rec: DraftRecord,
    s: RoundState,
    *,
    vocab: int,
    code: int,
    pdl: bool = False,
) -> None:
    """As reference.twins.round_record.settle_round_ref, in one launch."""
    dev = s.m.device
    i32, i64 = (torch.int32,), (torch.int64,)
    rows, hid = s.hidden.shape if s.hidden.dim() == 2 else (0, 0)
    check_tensor("s.hidden", s.hidden, shape=(rows, hid), dtypes=(torch.bfloat16,), device=dev)
    check_tensor("hidden", hidden, shape=(rows, hid), dtypes=(torch.bfloat16,), device=dev)
    for name, t in (("hidden", hidden), ("s.hidden", s.hidden)):
        if t.stride(1) != 1 and hid > 1:
            raise ValueError(f"{name}: expected unit column stride, got {t.stride()}")
    for name in ("m", "draft_next", "hidden_at", "n_new", "max_new", "done", "round_no"):
        check_tensor(f"s.{name}", getattr(s, name), shape=(1,), dtypes=i32, device=dev)
    check_tensor("s.fault", s.fault, shape=(4,), dtypes=i64, device=dev)
    check_tensor("s.tokens", s.tokens, dims=1, dtypes=i64, device=dev)
    check_tensor("s.stop", s.stop, dims=1, dtypes=i64, device=dev)
    db, width = rec.q_ids.shape if rec.q_ids.dim() == 2 else (0, 0)
    if rows < 2 or db != rows - 1:
        raise ValueError(f"rec.q_ids: expected [{rows - 1}, W] (R − 1 draft slots of R = "
                         f"{rows} rows), got shape {tuple(rec.q_ids.shape)}")
    log_rows = s.head.shape[0]
    check_tensor("s.head", s.head, shape=(log_rows, 5), dtypes=i32, device=dev)
    check_tensor("s.emitted", s.emitted, shape=(log_rows, rows), dtypes=i64, device=dev)
    check_tensor("s.drafts", s.drafts, shape=(log_rows, db), dtypes=i64, device=dev)
    check_tensor("s.q_ids", s.q_ids, shape=(log_rows, db, width), dtypes=i64, device=dev)
    check_tensor("s.q_probs", s.q_probs, shape=(log_rows, db, width),
                 dtypes=(torch.float32,), device=dev)
    check_tensor("rec.q_probs", rec.q_probs, shape=(db, width), dtypes=(torch.float32,),
                 device=dev)
    check_tensor("rec.drafts", rec.drafts, shape=(db,), dtypes=i64, device=dev)
    check_tensor("rec.n_d", rec.n_d, shape=(1,), dtypes=i32, device=dev)
    check_tensor("keep_d", keep_d, shape=(1,), dtypes=i32, device=dev)
    check_tensor("v.n_accepted", v.n_accepted, shape=(1,), dtypes=i32, device=dev)
    check_tensor("v.next_token", v.next_token, dims=1, dtypes=i64, device=dev)
    check_tensor("v.bonus", v.bonus, shape=(1,), dtypes=i32, device=dev)
    check_tensor("v.emitted", v.emitted, dims=1, dtypes=i64, device=dev)
    for name, t in (("s.tokens", s.tokens), ("s.stop", s.stop), ("s.head", s.head),
                    ("s.emitted", s.emitted), ("s.drafts", s.drafts), ("s.q_ids", s.q_ids),
                    ("s.q_probs", s.q_probs), ("rec.q_ids", rec.q_ids),
                    ("rec.q_probs", rec.q_probs), ("rec.drafts", rec.drafts),
                    ("v.emitted", v.emitted)):
        _contiguous(name, t)
    if v.next_token.shape[0] < 1 or v.emitted.shape[0] < 1 or s.stop.shape[0] < 1:
        raise ValueError("v.next_token, v.emitted and s.stop: expected at least one element")
    _check_int("vocab", vocab, 1, 2**31)
    _check_int("code", code, 1, 2**31)
    p2 = triton.next_power_of_2
    _settle_kernel[(1,)](
        v.n_accepted, v.next_token, v.bonus, v.emitted, keep_d, hidden, rec.n_d, rec.drafts,
        rec.q_ids, rec.q_probs, s.tokens, s.stop, s.m, s.draft_next, s.hidden, s.hidden_at,
        s.n_new, s.max_new, s.done, s.round_no, s.fault, s.head, s.emitted, s.drafts, s.q_ids,
        s.q_probs, hidden.stride(0), s.hidden.stride(0), rows, s.stop.shape[0],
        v.emitted.shape[0], db, db * width, s.tokens.shape[0] - 1, log_rows - 1, vocab, code,
        H=hid, BLOCK_R=p2(rows), BLOCK_HC=min(512, p2(max(hid, 1))), BLOCK_S=p2(s.stop.shape[0]),
        BLOCK_DB=p2(db), BLOCK_DBW=p2(max(db * width, 1)), num_warps=4, **launch_opts(pdl))
