"""Speculative rejection verification on the device (kernel family 7).
Twin: reference/twins/verify.py `verify_ref` (reference.rejection.verify on densified rows);
bit-exact with it: no exp and no division other than div_rn, sums in the reference's order.

Dimension letters: D drafts (buffer width; n_drafts ≤ D are live), DP = next power of two
≥ D + 1, Kp / Kq widths of the sparse target / draft rows, KP / KQ their powers of two.

Inputs are the sampler's sparse served rows: target p (ids, probs) [D+1, Kp] for positions
first … first + D, draft q [D, Kq] for the drafts' positions. An id's probability in a row is
the probability stored next to it (0 if absent; entries with probability 0, e.g. −1 padding,
are no support). One program runs the whole round:
  * acceptance, all rows at once: accept drafts[j] = d iff fl(u_acc · q_j(d)) < p_j(d), with
    u_acc = uniforms(seed, first + j, ACCEPT); a = the first rejected j, or n_drafts.
  * row a: a < n_drafts → the residual r = max(0, p_a − q_a) over p_a's support (the union
    adds only zeros), Z = its sequential fp32 sum in id order, r / Z (div_rn), or p_a when
    Z = 0; a = n_drafts → the bonus row p_a. One draw (reference.sampling.draw) with
    u = uniforms(seed, first + a, TARGET_SAMPLE).
Outputs stay on the device: n_accepted, next_token, bonus, and the emitted tokens (accepted
drafts, then next_token, then −1). Values are not checked (no host sync): a q row without the
draft in its support, or NaN probabilities, give unspecified results (the twin raises).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import launch_opts, pdl_enter
from kernels.sampler.checks import seed_args
from kernels.sampler.device import _COMPILE, draw_stored, rank_desc, seq_sum, uniform
from kernels.twin import twin
from reference.op_types import VerifyOut
from reference.twins import verify as _twins

MAX_DRAFTS = 15
MAX_WIDTH = 64


@triton.jit
def _verify_kernel(
    p_ids_ptr, p_probs_ptr, q_ids_ptr, q_probs_ptr, drafts_ptr, nd_ptr,
    seed, seed_ptr, first, first_ptr,
    acc_ptr, tok_ptr, bonus_ptr, emit_ptr, wf_ptr, wi_ptr,
    D, WP, WQ, s_pi, s_pp, s_qi, s_qp, b_pi, b_pp, b_qi, b_qp,
    DP: tl.constexpr, KP: tl.constexpr, KQ: tl.constexpr,
    SEED_FROM_PTR: tl.constexpr, FIRST_FROM_PTR: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    # program b verifies round b of a batch (b_* are the batch strides; one round: b = 0)
    b = tl.program_id(0).to(tl.int64)
    p_ids_ptr += b * b_pi
    p_probs_ptr += b * b_pp
    q_ids_ptr += b * b_qi
    q_probs_ptr += b * b_qp
    drafts_ptr += b * D
    acc_ptr += b
    tok_ptr += b
    bonus_ptr += b
    emit_ptr += b * (D + 1)
    wf_ptr += b * KP
    wi_ptr += b * KP
    if SEED_FROM_PTR:
        sd = tl.load(seed_ptr)
    else:
        sd = seed
    if FIRST_FROM_PTR:
        pos0 = tl.load(first_ptr + b).to(tl.int64)
    else:
        pos0 = tl.full([], 0, tl.int64) + first
    nd = tl.minimum(tl.load(nd_ptr), D)
    j = tl.arange(0, DP)  # [DP] draft rows
    live = j < nd
    d = tl.load(drafts_ptr + j, mask=live, other=-1).to(tl.int64)
    cp = tl.arange(0, KP)
    cq = tl.arange(0, KQ)
    mp = live[:, None] & (cp < WP)[None, :]  # [DP, KP]
    mq = live[:, None] & (cq < WQ)[None, :]  # [DP, KQ]
    pid = tl.load(p_ids_ptr + j[:, None] * s_pi + cp[None, :], mask=mp, other=-1).to(tl.int64)
    pv = tl.load(p_probs_ptr + j[:, None] * s_pp + cp[None, :], mask=mp, other=0.0)
    qid = tl.load(q_ids_ptr + j[:, None] * s_qi + cq[None, :], mask=mq, other=-1).to(tl.int64)
    qv = tl.load(q_probs_ptr + j[:, None] * s_qp + cq[None, :], mask=mq, other=0.0)
    p_d = tl.sum(tl.where((pid == d[:, None]) & (pv > 0.0), pv, 0.0), axis=1)  # [DP] p_j(d_j)
    q_d = tl.sum(tl.where((qid == d[:, None]) & (qv > 0.0), qv, 0.0), axis=1)
    u_acc = uniform(sd, pos0 + j, 1, 0)  # ACCEPT
    rejected = live & ~(u_acc * q_d < p_d)
    a = tl.min(tl.where(rejected, j, nd), axis=0)
    bonus = a == nd
    # row a: the residual (a < nd) or the bonus row (a = nd)
    rp = tl.arange(0, KP) < WP
    ids = tl.load(p_ids_ptr + a * s_pi + cp, mask=rp, other=-1).to(tl.int64)  # [KP]
    p = tl.load(p_probs_ptr + a * s_pp + cp, mask=rp, other=0.0)
    rq = (cq < WQ) & (a < nd)
    qi = tl.load(q_ids_ptr + a * s_qi + cq, mask=rq, other=-1).to(tl.int64)  # [KQ]
    qp = tl.load(q_probs_ptr + a * s_qp + cq, mask=rq, other=0.0)
    sup = p > 0.0
    q_at = tl.sum(tl.where((qi[None, :] == ids[:, None]) & (qp > 0.0)[None, :], qp[None, :], 0.0),
                  axis=1)  # [KP] q_a at p_a's ids
    diff = tl.where(sup, tl.maximum(p - q_at, 0.0), 0.0)
    # sequential sums run over the scratch row: store in order, barrier, scalar loop
    n_sup = tl.sum(sup.to(tl.int32), axis=0)
    tl.store(wf_ptr + rank_desc(tl.zeros([KP], tl.float32), ids, sup), diff, mask=sup)  # id asc
    tl.debug_barrier()
    z = seq_sum(wf_ptr, n_sup, KP)
    zd = tl.full(diff.shape, 1.0, tl.float32) * tl.where(z == 0.0, 1.0, z)
    resid = tl.where(z == 0.0, p, tl.div_rn(diff, zd))  # zero residual mass: p itself
    dist = tl.where(bonus, p, resid)
    keep = sup & (dist > 0.0)
    rd = rank_desc(dist, ids, keep)  # draw order (prob desc, id asc)
    tl.debug_barrier()
    tl.store(wf_ptr + rd, dist, mask=keep)
    tl.store(wi_ptr + rd, ids, mask=keep)
    tl.debug_barrier()
    u = uniform(sd, pos0 + a, 0, 0)  # TARGET_SAMPLE
    tok = draw_stored(wf_ptr, wi_ptr, tl.sum(keep.to(tl.int32), axis=0), KP, u)
    tl.store(acc_ptr, a)
    tl.store(tok_ptr, tok)
    tl.store(bonus_ptr, bonus.to(tl.int32))
    emit = tl.where(j < a, d, tl.where(j == a, tok, -1))
    tl.store(emit_ptr + j, emit, mask=j <= D)


def _fail(msg: str):
    raise ValueError(f"kernels.verify: {msg}")


def _check(name, t, shape, dtypes, device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(
        w is not None and w != g for w, g in zip(shape, t.shape, strict=True)
    ):
        want = ", ".join("*" if w is None else str(w) for w in shape)
        _fail(f"{name} must have shape ({want}), got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        _fail(f"{name} must be on {device}, got {t.device}")
    if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
        _fail(f"{name} must have unit column stride, got strides {t.stride()}")


IDS = (torch.int32, torch.int64)


@twin(_twins.verify_ref)
def verify(
    p_ids: torch.Tensor,  # [D+1, Kp] int32/int64 target served ids (sampler output)
    p_probs: torch.Tensor,  # [D+1, Kp] fp32
    q_ids: torch.Tensor,  # [D, Kq] draft served ids
    q_probs: torch.Tensor,  # [D, Kq] fp32
    drafts: torch.Tensor,  # [D] int32/int64 draft tokens
    seed,  # int in [0, 2^64) or device int64 [1]
    first_position,  # int in [0, 2^32 - D) or device int64/int32 [1]: position of drafts[0]
    *,
    n_drafts: torch.Tensor | None = None,  # device int32 [1], live drafts ≤ D (default D)
    out: VerifyOut | None = None,
    pdl: bool = False,
) -> VerifyOut:
    """Accepted count, replacement or bonus token, all written on the device.
    Twin: reference.twins.verify.verify_ref.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    if not isinstance(drafts, torch.Tensor) or drafts.dim() != 1:
        _fail(f"drafts must be a 1-D tensor [D], got {getattr(drafts, 'shape', drafts)}")
    D, dev = drafts.shape[0], drafts.device
    if D > MAX_DRAFTS:
        _fail(f"at most {MAX_DRAFTS} drafts per round, got D={D}")
    _check("drafts", drafts, (D,), IDS, dev)
    _check("p_ids", p_ids, (D + 1, None), IDS, dev)
    wp = p_ids.shape[1]
    _check("p_probs", p_probs, (D + 1, wp), (torch.float32,), dev)
    _check("q_ids", q_ids, (D, None), IDS, dev)
    wq = q_ids.shape[1]
    _check("q_probs", q_probs, (D, wq), (torch.float32,), dev)
    for name, w in (("p", wp), ("q", wq)):
        if not 1 <= w <= MAX_WIDTH:
            _fail(f"{name} rows must have 1..{MAX_WIDTH} served entries, got {w}")
    seed_v, seed_t = seed_args(seed, dev)
    if isinstance(first_position, torch.Tensor):
        _check("first_position", first_position, (1,), IDS, dev)
        first_v, first_t = 0, first_position
    elif isinstance(first_position, bool) or not isinstance(first_position, int) or not (
        0 <= first_position and first_position + D < 2**32
    ):
        _fail(f"first_position must be an int with positions {first_position!r}…+{D} in "
              "[0, 2^32), or a device tensor [1]")
    else:
        first_v, first_t = first_position, None
    if n_drafts is None:
        n_drafts = torch.full((1,), D, dtype=torch.int32, device=dev)
    _check("n_drafts", n_drafts, (1,), (torch.int32,), dev)
    if out is None:
        out = VerifyOut(
            torch.empty(1, dtype=torch.int32, device=dev),
            torch.empty(1, dtype=torch.int64, device=dev),
            torch.empty(1, dtype=torch.int32, device=dev),
            torch.empty(D + 1, dtype=torch.int64, device=dev),
        )
    else:
        if not isinstance(out, VerifyOut):
            _fail("out must be a VerifyOut")
        for name, t, shape, dt in zip(
            ("out.n_accepted", "out.next_token", "out.bonus", "out.emitted"), out,
            ((1,), (1,), (1,), (D + 1,)), (torch.int32, torch.int64, torch.int32, torch.int64),
            strict=True,
        ):
            _check(name, t, shape, (dt,), dev)
    dummy = out.next_token
    kp = max(2, triton.next_power_of_2(wp))
    work_f = torch.empty(kp, dtype=torch.float32, device=dev)  # per-call scratch rows
    work_i = torch.empty(kp, dtype=torch.int64, device=dev)
    q_i = q_ids if D else dummy  # D = 0: nothing of q is read
    q_p = q_probs if D else dummy
    _verify_kernel[(1,)](
        p_ids, p_probs, q_i, q_p, drafts if D else dummy, n_drafts,
        seed_v, seed_t if seed_t is not None else dummy, first_v,
        first_t if first_t is not None else dummy,
        out.n_accepted, out.next_token, out.bonus, out.emitted, work_f, work_i,
        D, wp, wq, p_ids.stride(0), p_probs.stride(0), q_ids.stride(0) if D else 0,
        q_probs.stride(0) if D else 0, 0, 0, 0, 0,
        DP=max(2, triton.next_power_of_2(D + 1)), KP=kp,
        KQ=max(2, triton.next_power_of_2(wq)), SEED_FROM_PTR=seed_t is not None,
        FIRST_FROM_PTR=first_t is not None, num_warps=4, **launch_opts(pdl, **_COMPILE),
    )
    return out


def verify_batch(
    p_ids: torch.Tensor,  # [B, D+1, Kp] target served ids, round b's rows at [b]
    p_probs: torch.Tensor,  # [B, D+1, Kp] fp32
    q_ids: torch.Tensor,  # [B, D, Kq]
    q_probs: torch.Tensor,  # [B, D, Kq] fp32
    drafts: torch.Tensor,  # [B, D]
    seed,  # int in [0, 2^64) or device int64 [1], shared by the batch
    first_positions: torch.Tensor,  # [B] int64 device: position of round b's drafts[0]
    *,
    pdl: bool = False,
) -> VerifyOut:
    """B independent rounds in one launch (program b = round b): exactly `verify` on each round's
    rows with its own first position — for the statistical gates, which sample ~10^5 rounds.
    Outputs: n_accepted [B], next_token [B], bonus [B], emitted [B, D+1].
    pdl: programmatic dependent launch (kernels/launch.py)."""
    if not isinstance(drafts, torch.Tensor) or drafts.dim() != 2:
        _fail(f"drafts must be a 2-D tensor [B, D], got {getattr(drafts, 'shape', drafts)}")
    B, D = drafts.shape
    dev = drafts.device
    if not 1 <= D <= MAX_DRAFTS:
        _fail(f"verify_batch needs 1..{MAX_DRAFTS} drafts per round, got D={D}")
    wp, wq = p_ids.shape[-1], q_ids.shape[-1]
    for name, t, shape, dts in (
        ("drafts", drafts, (B, D), IDS), ("p_ids", p_ids, (B, D + 1, wp), IDS),
        ("p_probs", p_probs, (B, D + 1, wp), (torch.float32,)),
        ("q_ids", q_ids, (B, D, wq), IDS), ("q_probs", q_probs, (B, D, wq), (torch.float32,)),
        ("first_positions", first_positions, (B,), (torch.int64,)),
    ):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            _fail(f"{name} must have shape {shape}, got {tuple(getattr(t, 'shape', ()))}")
        if t.dtype not in dts or t.device != dev:
            _fail(f"{name} must be {[str(d) for d in dts]} on {dev}, got {t.dtype} on {t.device}")
        if t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) < t.shape[2]) or (
            t.dim() == 2 and name == "drafts" and t.stride(0) != D
        ):
            _fail(f"{name} must be contiguous in its rows, got strides {t.stride()}")
    for name, w in (("p", wp), ("q", wq)):
        if not 1 <= w <= MAX_WIDTH:
            _fail(f"{name} rows must have 1..{MAX_WIDTH} served entries, got {w}")
    seed_v, seed_t = seed_args(seed, dev)
    out = VerifyOut(
        torch.empty(B, dtype=torch.int32, device=dev),
        torch.empty(B, dtype=torch.int64, device=dev),
        torch.empty(B, dtype=torch.int32, device=dev),
        torch.empty(B, D + 1, dtype=torch.int64, device=dev),
    )
    if B == 0:
        return out
    kp = max(2, triton.next_power_of_2(wp))
    work_f = torch.empty(B, kp, dtype=torch.float32, device=dev)  # one scratch row per program
    work_i = torch.empty(B, kp, dtype=torch.int64, device=dev)
    nd = torch.full((1,), D, dtype=torch.int32, device=dev)
    _verify_kernel[(B,)](
        p_ids, p_probs, q_ids, q_probs, drafts, nd,
        seed_v, seed_t if seed_t is not None else out.next_token, 0, first_positions,
        out.n_accepted, out.next_token, out.bonus, out.emitted, work_f, work_i,
        D, wp, wq, p_ids.stride(1), p_probs.stride(1), q_ids.stride(1), q_probs.stride(1),
        p_ids.stride(0), p_probs.stride(0), q_ids.stride(0), q_probs.stride(0),
        DP=max(2, triton.next_power_of_2(D + 1)), KP=kp,
        KQ=max(2, triton.next_power_of_2(wq)), SEED_FROM_PTR=seed_t is not None,
        FIRST_FROM_PTR=True, num_warps=4, **launch_opts(pdl, **_COMPILE),
    )
    return out
