"""The round program's scalar arithmetic between the model's launches, in three one-program kernels
(twins: reference/twins/round_scalars.py; caller: iquestrt/round.py):

begin_round    before depth 0: go, depth 0's catch-up rows c, hidden base and last row, the draft
               positions pos[j] = draft_next + c + j, the control features; the draft record
               emptied (drafts, n_d, the skippable depths' q rows).
target_rows    after the depths: the verification rows [x_m, y_1 …], their positions and draws,
               the draft cache's next position pos[0] + n_d − 1 (draft_next when none ran).
settle_bounds  after verification: the target and draft caches' rollback bounds.

Each replaces a run of torch elementwise ops (a launch each inside the captured round: ≈ 17,
15 and 7 at depth 5) by one launch; integer and select logic only, equal to the twins bit for
bit. Every value is read before any is written: a kernel's outputs never alias its inputs.

Dimension letters: R rows, Db = R − 1 draft slots, W served width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_tensor
from kernels.launch import launch_opts, pdl_enter
from kernels.twin import twin
from reference.op_types import (
    DraftRecord,
    RoundBegin,
    RoundState,
    SettleBounds,
    TargetRows,
    VerifyOut,
)
from reference.twins import round_scalars as _twins


@triton.jit
def _begin_kernel(m_ptr, dn_ptr, hat_ptr, done_ptr, go_ptr, c_ptr, hb_ptr, last_ptr, pos_ptr,
                  feat_ptr, d_ptr, nd_ptr, qi_ptr, qp_ptr, DB, Q_FROM, Q_END,
                  BLOCK_DB: tl.constexpr, BLOCK_Q: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    dn = tl.load(dn_ptr)
    go = 1 - tl.load(done_ptr)
    c = (tl.load(m_ptr) - dn + 1) * go
    tl.store(go_ptr, go)
    tl.store(c_ptr, c)
    tl.store(hb_ptr, dn - 1 - tl.load(hat_ptr))
    tl.store(last_ptr, tl.maximum(c - 1, 0).to(tl.int64))
    j = tl.arange(0, BLOCK_DB)
    tl.store(pos_ptr + j, dn + c + j, mask=j < DB)
    tl.store(d_ptr + j, tl.zeros([BLOCK_DB], tl.int64), mask=j < DB)
    tl.store(nd_ptr, 0)
    k = tl.arange(0, 4)
    tl.store(feat_ptr + k, tl.where(k == 0, 1.0, 0.0), mask=k < 3)  # (cum, q, h) = (1, 0, 0)
    q = Q_FROM + tl.arange(0, BLOCK_Q)  # flat [Db·W] index: rows ≥ clear_from
    qm = q < Q_END
    tl.store(qi_ptr + q, tl.full([BLOCK_Q], -1, tl.int64), mask=qm)
    tl.store(qp_ptr + q, tl.zeros([BLOCK_Q], tl.float32), mask=qm)


@triton.jit
def _target_rows_kernel(m_ptr, dn_ptr, tok_ptr, d_ptr, nd_ptr, go_ptr, bpos_ptr, nt_ptr,
                        ttok_ptr, tpos_ptr, spos_ptr, first_ptr, nxt_ptr, R,
                        BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    m = tl.load(m_ptr)
    nd = tl.load(nd_ptr)
    n_t = (nd + 1) * tl.load(go_ptr)
    r = tl.arange(0, BLOCK_R)
    rm = r < R
    x_m = tl.load(tok_ptr + m.to(tl.int64))
    drafts = tl.load(d_ptr + r - 1, mask=rm & (r >= 1), other=0)  # row r ≥ 1: y_r = drafts[r − 1]
    tl.store(ttok_ptr + r, tl.where(r == 0, x_m, drafts), mask=rm)
    tl.store(tpos_ptr + r, tl.where(r < n_t, m + r, -1), mask=rm)
    tl.store(spos_ptr + r, (m + 1 + r).to(tl.int64), mask=rm)
    tl.store(first_ptr, (m + 1).to(tl.int64))
    tl.store(nt_ptr, n_t)
    tl.store(nxt_ptr, tl.where(nd > 0, tl.load(bpos_ptr) + nd - 1, tl.load(dn_ptr)))


@triton.jit
def _settle_bounds_kernel(acc_ptr, go_ptr, m_ptr, nt_ptr, nxt_ptr, keep_ptr, wr_ptr, kd_ptr,
                          RECOMPUTE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    go = tl.load(go_ptr)
    m = tl.load(m_ptr)
    n_em = (tl.load(acc_ptr) * go + 1) * go  # tokens this round emits
    tl.store(keep_ptr, m + n_em)
    tl.store(wr_ptr, m + tl.load(nt_ptr))
    if RECOMPUTE:
        settled = m + go
    else:
        settled = m + n_em
    tl.store(kd_ptr, tl.minimum(settled, tl.load(nxt_ptr)))


# --- wrappers ----------------------------------------------------------------------------------

_I32, _I64 = (torch.int32,), (torch.int64,)


def _check_scalars(dev, **named) -> None:
    """Each named tensor: [1] int32 on dev."""
    for name, t in named.items():
        check_tensor(name, t, shape=(1,), dtypes=_I32, device=dev)


def _check_record(rec: DraftRecord, dev) -> tuple[int, int]:
    """rec contiguous, [Db, W] / [Db, W] / [Db] / [1] → (Db, W)."""
    db, width = rec.q_ids.shape if rec.q_ids.dim() == 2 else (0, 0)
    check_tensor("rec.q_ids", rec.q_ids, shape=(db, width), dtypes=_I64, device=dev)
    check_tensor("rec.q_probs", rec.q_probs, shape=(db, width), dtypes=(torch.float32,),
                 device=dev)
    check_tensor("rec.drafts", rec.drafts, shape=(db,), dtypes=_I64, device=dev)
    check_tensor("rec.n_d", rec.n_d, shape=(1,), dtypes=_I32, device=dev)
    for name, t in (("rec.q_ids", rec.q_ids), ("rec.q_probs", rec.q_probs),
                    ("rec.drafts", rec.drafts)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if db < 1:
        raise ValueError("rec: expected at least one draft slot")
    return db, width


def _check_begin(b: RoundBegin, db: int, dev) -> None:
    _check_scalars(dev, **{"b.go": b.go, "b.c": b.c, "b.hid_base": b.hid_base})
    check_tensor("b.last", b.last, shape=(1,), dtypes=_I64, device=dev)
    check_tensor("b.pos", b.pos, shape=(db,), dtypes=_I32, device=dev)
    check_tensor("b.feat", b.feat, shape=(1, 3), dtypes=(torch.float32,), device=dev)
    if not (b.pos.is_contiguous() and b.feat.is_contiguous()):
        raise ValueError("b.pos, b.feat: expected contiguous tensors")


def _check_state(s: RoundState, dev) -> None:
    _check_scalars(dev, **{f"s.{n}": getattr(s, n) for n in ("m", "draft_next", "hidden_at",
                                                             "done")})
    check_tensor("s.tokens", s.tokens, dims=1, dtypes=_I64, device=dev)


@twin(_twins.begin_round_ref)
def begin_round(s: RoundState, rec: DraftRecord, b: RoundBegin, *, clear_from: int,
                pdl: bool = False) -> None:
    """As reference.twins.round_scalars.begin_round_ref, in one launch."""
    dev = s.m.device
    _check_state(s, dev)
    db, width = _check_record(rec, dev)
    _check_begin(b, db, dev)
    if not isinstance(clear_from, int) or not 0 <= clear_from <= db:
        raise ValueError(f"clear_from: expected an int in [0, {db}] (Db = {db} draft slots), got "
                         f"{clear_from!r}")
    p2 = triton.next_power_of_2
    n_q = (db - clear_from) * width
    _begin_kernel[(1,)](
        s.m, s.draft_next, s.hidden_at, s.done, b.go, b.c, b.hid_base, b.last, b.pos, b.feat,
        rec.drafts, rec.n_d, rec.q_ids, rec.q_probs, db, clear_from * width, db * width,
        BLOCK_DB=p2(db), BLOCK_Q=p2(max(n_q, 1)), num_warps=1, **launch_opts(pdl))


@twin(_twins.target_rows_ref)
def target_rows(s: RoundState, rec: DraftRecord, b: RoundBegin, t: TargetRows, *,
                pdl: bool = False) -> None:
    """As reference.twins.round_scalars.target_rows_ref, in one launch."""
    dev = s.m.device
    _check_state(s, dev)
    db, _ = _check_record(rec, dev)
    _check_begin(b, db, dev)
    rows = db + 1
    _check_scalars(dev, **{"t.n_t": t.n_t, "t.nxt": t.nxt})
    check_tensor("t.tokens", t.tokens, shape=(rows,), dtypes=_I64, device=dev)
    check_tensor("t.pos", t.pos, shape=(rows,), dtypes=_I32, device=dev)
    check_tensor("t.sample_pos", t.sample_pos, shape=(rows,), dtypes=_I64, device=dev)
    check_tensor("t.first", t.first, shape=(1,), dtypes=_I64, device=dev)
    for name in ("tokens", "pos", "sample_pos"):
        if not getattr(t, name).is_contiguous():
            raise ValueError(f"t.{name}: expected a contiguous tensor")
    _target_rows_kernel[(1,)](
        s.m, s.draft_next, s.tokens, rec.drafts, rec.n_d, b.go, b.pos, t.n_t, t.tokens, t.pos,
        t.sample_pos, t.first, t.nxt, rows, BLOCK_R=triton.next_power_of_2(rows), num_warps=1,
        **launch_opts(pdl))


@twin(_twins.settle_bounds_ref)
def settle_bounds(v: VerifyOut, s: RoundState, t: TargetRows, go: torch.Tensor,
                  out: SettleBounds, *, recompute: bool, pdl: bool = False) -> None:
    """As reference.twins.round_scalars.settle_bounds_ref, in one launch."""
    dev = s.m.device
    _check_scalars(dev, **{"v.n_accepted": v.n_accepted, "go": go, "s.m": s.m,
                           "t.n_t": t.n_t, "t.nxt": t.nxt, "out.keep": out.keep,
                           "out.written": out.written, "out.keep_d": out.keep_d})
    if not isinstance(recompute, bool):
        raise ValueError(f"recompute: expected a bool, got {recompute!r}")
    _settle_bounds_kernel[(1,)](
        v.n_accepted, go, s.m, t.n_t, t.nxt, out.keep, out.written, out.keep_d,
        RECOMPUTE=recompute, num_warps=1, **launch_opts(pdl))
