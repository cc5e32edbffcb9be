"""The MoE router on the device, in two launches that share one finish.

Folded into the attention tail launch (kernels/tails.py, `_router_program`): each router
program takes a block of experts, waits for the row programs' FP32 router input in the
scratch (RouterScratch.r_in), computes those experts' logits for every live row, and the last
to finish (an acq_rel counter) does softmax → top-k → renormalize, publishes ids and weights,
and restores the scratch invariant (counters 0; with NaN readiness also r_in all NaN) for the
next launch. Two ways to wait (TailLaunch.count_ready):
  NaN readiness — r_in is NaN until written; every router program re-reads all of r_in (8 rows
    × H FP32) until it holds no NaN, and the finish re-arms r_in with NaN;
  a ready counter — each row program raises RouterScratch.ready (release) after storing its
    row of r_in; a router program spins on that one int until it counts every row program,
    then reads r_in once; the finish sets the counter back to 0 and re-arms nothing.
A scratch serves one of the two: r_in stays finite after a counter launch.
Every wait is bounded (a failure flag, never a hang).

Standalone (`_route_kernel`, launched by kernels/rows.py route_rows with a RouteScratch): the
same expert blocks and finish over an input that is already in memory.

Dimension letters: RR route rows, H hidden, E experts (EALL padded), BE experts per program,
BK hidden columns per step, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import pdl_enter
from kernels.readiness import wait_count, wait_ready
from kernels.timeline import stamp


@triton.jit
def _softmax_topk_full(logit_ptr, rows, rl, EXPERTS: tl.constexpr, BLOCK_EALL: tl.constexpr,
                       TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, TOPK: tl.constexpr,
                       trace_ptr, pid, TRACE: tl.constexpr):
    """The logits as one [RR, EALL] tile → (valid [RR], top_p / top_i [RR, BLOCK_TOPK], wsum
    [RR]). On the GPU each row's reductions span every warp (the tile's experts are spread over
    all of them): two cross-warp reductions per top-k step (TOPK 0), one of int64 keys (TOPK 1).
    wsum is tl.sum over top_p (its order follows top_p's layout)."""
    ea = tl.arange(0, BLOCK_EALL)
    eam = ea < EXPERTS
    lm = rl[:, None] & eam[None, :]
    lg = tl.load(logit_ptr + rows[:, None] * EXPERTS + ea[None, :], mask=lm,
                 other=float("-inf"), volatile=True)  # [RR, EALL]
    finite = (lg == lg) & (tl.abs(lg) < float("inf"))
    valid = tl.min((finite | ~eam[None, :]).to(tl.int32), axis=1) == 1  # [RR]
    m = tl.where(rl, tl.max(lg, axis=1), 0.0)  # dead rows: no -inf - -inf
    p = tl.exp(lg - m[:, None])
    s = tl.where(rl, tl.sum(p, axis=1), 1.0)
    p = tl.div_rn(p, tl.broadcast_to(s[:, None], p.shape))
    p = tl.where(eam[None, :], p, -1.0)
    stamp(trace_ptr, pid, 4, TRACE)
    kc = tl.arange(0, BLOCK_TOPK)
    top_p = tl.zeros([rows.shape[0], BLOCK_TOPK], tl.float32)
    top_i = tl.zeros([rows.shape[0], BLOCK_TOPK], tl.int32)
    if TOPK == 1:
        low = (BLOCK_EALL - 1 - ea).to(tl.int64)
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | low[None, :]
        key = tl.where(eam[None, :], key, -1)
        for k in tl.static_range(TOP_K):
            top_key = tl.max(key, axis=1)
            top_idx = (BLOCK_EALL - 1 - (top_key & 0xFFFFFFFF)).to(tl.int32)
            top_val = (top_key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            top_p = tl.where(kc[None, :] == k, top_val[:, None], top_p)
            top_i = tl.where(kc[None, :] == k, top_idx[:, None], top_i)
            key = tl.where(key == top_key[:, None], -2, key)
    else:
        for k in tl.static_range(TOP_K):
            best = tl.max(p, axis=1)
            idx = tl.min(tl.where(p == best[:, None], ea[None, :], BLOCK_EALL), axis=1)
            top_p = tl.where(kc[None, :] == k, best[:, None], top_p)
            top_i = tl.where(kc[None, :] == k, idx[:, None], top_i)
            p = tl.where(ea[None, :] == idx[:, None], -2.0, p)
    return valid, top_p, top_i, tl.sum(top_p, axis=1)


@triton.jit
def _softmax_topk_groups(logit_ptr, rows, rl, EXPERTS: tl.constexpr,
                         BLOCK_EALL: tl.constexpr, TOP_K: tl.constexpr,
                         BLOCK_TOPK: tl.constexpr, trace_ptr, pid, TRACE: tl.constexpr):
    """TailLaunch.group_finish: the logits as NG tiles [RR, G] of G = min(32, EALL) experts
    (tile g holds experts g·G + lane), so that a row's reduction runs inside one warp (a warp
    spans a tile's G columns; no tile is split across warps) and the NG tiles meet by
    elementwise max / add in g order first. The same choices as _softmax_topk_full (max and
    min are exact; ties: the lower index); the softmax sum adds the tiles in g order, then
    within the warp, and wsum adds the top-k values in k order, so p and the weights may differ
    from the full tile's in the last bits (the kernels.router.weights row covers both).
    → (valid, top_p, top_i, wsum) as _softmax_topk_full."""
    G: tl.constexpr = min(32, BLOCK_EALL)
    NG: tl.constexpr = BLOCK_EALL // G
    RR: tl.constexpr = rows.shape[0]
    lane = tl.arange(0, G)
    lgs = ()  # NG × [RR, G]; all loads issued before any reduction
    for g in tl.static_range(NG):
        e = g * G + lane
        lgs = lgs + (tl.load(logit_ptr + rows[:, None] * EXPERTS + e[None, :],
                             mask=rl[:, None] & (e < EXPERTS)[None, :], other=float("-inf"),
                             volatile=True),)
    bad = tl.zeros([RR, G], tl.int32)
    mx = lgs[0]
    for g in tl.static_range(NG):
        finite = (lgs[g] == lgs[g]) & (tl.abs(lgs[g]) < float("inf"))
        bad = bad | (~finite & (g * G + lane < EXPERTS)[None, :]).to(tl.int32)
        mx = tl.maximum(mx, lgs[g])
    valid = tl.max(bad, axis=1) == 0  # [RR]
    m = tl.where(rl, tl.max(mx, axis=1), 0.0)  # dead rows: no -inf - -inf
    ps = ()
    acc = tl.zeros([RR, G], tl.float32)
    for g in tl.static_range(NG):
        pg = tl.exp(lgs[g] - m[:, None])
        ps = ps + (pg,)
        acc = acc + pg
    s = tl.where(rl, tl.sum(acc, axis=1), 1.0)
    qs = ()
    for g in tl.static_range(NG):
        pg = tl.div_rn(ps[g], tl.broadcast_to(s[:, None], ps[g].shape))
        qs = qs + (tl.where((g * G + lane < EXPERTS)[None, :], pg, -1.0),)
    stamp(trace_ptr, pid, 4, TRACE)
    kc = tl.arange(0, BLOCK_TOPK)
    top_p = tl.zeros([RR, BLOCK_TOPK], tl.float32)
    top_i = tl.zeros([RR, BLOCK_TOPK], tl.int32)
    wsum = tl.zeros([RR], tl.float32)
    for k in tl.static_range(TOP_K):
        mg = qs[0]
        for g in tl.static_range(1, NG):
            mg = tl.maximum(mg, qs[g])
        best = tl.max(mg, axis=1)
        ig = tl.full([RR, G], BLOCK_EALL, tl.int32)
        for g in tl.static_range(NG):
            ig = tl.minimum(ig, tl.where(qs[g] == best[:, None], g * G + lane[None, :],
                                         BLOCK_EALL))
        idx = tl.min(ig, axis=1)
        top_p = tl.where(kc[None, :] == k, best[:, None], top_p)
        top_i = tl.where(kc[None, :] == k, idx[:, None], top_i)
        wsum = wsum + best
        nq = ()
        for g in tl.static_range(NG):
            nq = nq + (tl.where(g * G + lane[None, :] == idx[:, None], -2.0, qs[g]),)
        qs = nq
    return valid, top_p, top_i, wsum


@triton.jit
def _route_finish(logit_ptr, ids_ptr, wts_ptr, rin_ptr, cnt_ptr, flag_ptr,
                  stride_ir, stride_ik, stride_wr, stride_wk, rows, rl,
                  HIDDEN: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_EALL: tl.constexpr,
                  TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_K: tl.constexpr,
                  REARM_RIN: tl.constexpr, TOPK: tl.constexpr = 0,
                  trace_ptr=None, pid=0, TRACE: tl.constexpr = False):
    """Last router program: softmax → top-k (ties: lower index) → renormalize, as ops.route.
    TRACE (kernels/timeline.py): slot 4 after the softmax, 5 after the top-k, 6 once ids and
    weights are stored (before the re-arm).
    REARM_RIN: restore r_in to NaN (the folded router's handoff); a standalone route
    (`_route_kernel`) reads a tensor it does not own and leaves it alone.
    TOPK (kernels/tails_launch.py topk_mode): 0 — TOP_K steps, each a max over p and a min over
    the indices that reach it; 1 (packed) — each step one int64 max over keys (p's bits << 32 |
    EALL − 1 − index): the same choice (p ≥ 0, so its bits order as it does; equal p → the
    larger low word, the lower index) in one reduction per step; 2 (groups) — the steps of 0
    over warp-sized tiles (_softmax_topk_groups). All three pick the same experts in the same
    order; 0 and 1 with the same values, 2 within the weights' tolerance of them."""
    if TOPK == 2:
        valid, top_p, top_i, wsum = _softmax_topk_groups(
            logit_ptr, rows, rl, EXPERTS, BLOCK_EALL, TOP_K, BLOCK_TOPK, trace_ptr, pid, TRACE)
    else:
        valid, top_p, top_i, wsum = _softmax_topk_full(
            logit_ptr, rows, rl, EXPERTS, BLOCK_EALL, TOP_K, BLOCK_TOPK, TOPK, trace_ptr, pid,
            TRACE)
    stamp(trace_ptr, pid, 5, TRACE)
    kc = tl.arange(0, BLOCK_TOPK)
    wsum = tl.where(rl, wsum, 1.0)
    w = tl.div_rn(top_p, tl.broadcast_to(wsum[:, None], top_p.shape))
    w = tl.where(valid[:, None], w, float("nan"))
    ids = tl.where(valid[:, None], top_i, -1)
    km = rl[:, None] & (kc[None, :] < TOP_K)
    tl.store(ids_ptr + rows[:, None] * stride_ir + kc[None, :] * stride_ik, ids, mask=km)
    tl.store(wts_ptr + rows[:, None] * stride_wr + kc[None, :] * stride_wk, w, mask=km)
    tl.store(flag_ptr, 1, mask=tl.sum((rl & ~valid).to(tl.int32), axis=0) > 0)
    stamp(trace_ptr, pid, 6, TRACE)
    # restore the scratch invariant: r_in NaN (rows written this launch), counter 0
    if REARM_RIN:
        for k0 in range(0, HIDDEN, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            nan = tl.full([rows.shape[0], BLOCK_K], float("nan"), tl.float32)
            tl.store(rin_ptr + rows[:, None] * HIDDEN + kk[None, :], nan,
                     mask=rl[:, None] & (kk < HIDDEN)[None, :])
    tl.store(cnt_ptr, 0)


@triton.jit
def _publish(acc, e, em, rows, rl, logit_ptr, ids_ptr, wts_ptr, rin_ptr, cnt_ptr, flag_ptr,
             stride_ir, stride_ik, stride_wr, stride_wk, n_router,
             HIDDEN: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_EALL: tl.constexpr,
             TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_K: tl.constexpr,
             REARM_RIN: tl.constexpr, TOPK: tl.constexpr = 0,
             trace_ptr=None, pid=0, TRACE: tl.constexpr = False,
             ready_ptr=None, COUNT_READY: tl.constexpr = False):
    """Store this program's logits [RR, BE], arrive on the counter; the last arrival routes
    (and with COUNT_READY sets the ready counter back to 0: every router program has passed
    its wait, since each arrives after it).
    TRACE (kernels/timeline.py): slot 2 after the arrival, slot 3 after the finish."""
    tl.store(logit_ptr + rows[:, None] * EXPERTS + e[None, :], acc,
             mask=rl[:, None] & em[None, :])
    # release: every thread's logits are stored before the counter moves
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    stamp(trace_ptr, pid, 2, TRACE)
    if done == n_router - 1:
        _route_finish(logit_ptr, ids_ptr, wts_ptr, rin_ptr, cnt_ptr, flag_ptr,
                      stride_ir, stride_ik, stride_wr, stride_wk, rows, rl,
                      HIDDEN, EXPERTS, BLOCK_EALL, TOP_K, BLOCK_TOPK, BLOCK_K, REARM_RIN,
                      TOPK, trace_ptr, pid, TRACE)
        if COUNT_READY:
            tl.store(ready_ptr, 0)
        stamp(trace_ptr, pid, 3, TRACE)


@triton.jit
def _rin_ptrs(rin_ptr, rows, k0, HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """Router-input chunk [k0, k0 + BK) of every route row as [RR, 1, BK] pointers: loaded in
    the [RR, BE, BK] product's own layout (a [RR, BK] tile would be converted to it through
    shared memory, ≈ 20 barriers per chunk on sm_90)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    return rin_ptr + rows[:, None, None] * HIDDEN + kk[None, None, :]


@triton.jit
def _rin_mask(rl, k0, HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr):
    kk = k0 + tl.arange(0, BLOCK_K)
    return rl[:, None, None] & (kk < HIDDEN)[None, None, :]  # [RR, 1, BK]


@triton.jit
def _load_w(rw_ptr, e, em, k0, HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """Router weights of experts e, columns [k0, k0 + BK) → [1, BE, BK] (the product's layout)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(rw_ptr + e[None, :, None] * HIDDEN + kk[None, None, :],
                   mask=em[None, :, None] & (kk < HIDDEN)[None, None, :], other=0.0)


@triton.jit
def _router_program(
    rin_ptr, rw_ptr, logit_ptr, cnt_ptr, ids_ptr, wts_ptr, flag_ptr,
    stride_ir, stride_ik, stride_wr, stride_wk, j, n_router, n, max_polls, ready_ptr, n_rows,
    HIDDEN: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_EALL: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_TOPK: tl.constexpr, ROUTE_ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, UNROLL_K: tl.constexpr, TOPK: tl.constexpr = 0,
    PREFETCH_W: tl.constexpr = False, trace_ptr=None, pid=0, TRACE: tl.constexpr = False,
    COUNT_READY: tl.constexpr = False,
):
    """Experts [j·BLOCK_E, (j+1)·BLOCK_E) for all live rows; the last one to finish routes.
    UNROLL_K: poll the whole router input at once instead of chunk by chunk (a chunk-by-chunk
    wait is a chain of dependent volatile loads and reductions: measured 47–49 µs per tail on
    the H200 at any row count, 24 chunks).
    PREFETCH_W: load every chunk of this program's router weights before the first wait, so
    the HBM reads overlap the row programs instead of following each chunk's wait (or, with
    UNROLL_K, being issued again by every poll); the same products summed in the same order
    (bit-equal logits with either poll).
    COUNT_READY: wait until the ready counter counts all n_rows row programs (one int polled
    instead of all of r_in), then issue the loads of every chunk of r_in at once and multiply
    chunk by chunk — the chunked poll's products and order, so its logits equal the chunked NaN
    path's bit for bit (UNROLL_K has no effect).
    TRACE (kernels/timeline.py, pid = the launch's program id): slot 8 once the wait for the
    router input is over (NaN readiness: after the last chunk's wait or the unrolled poll;
    COUNT_READY: after the counter read), slot 1 once the logits are computed, then
    _publish's slots."""
    rows = tl.arange(0, ROUTE_ROWS)
    rl = rows < n
    e = j * BLOCK_E + tl.arange(0, BLOCK_E)
    em = e < EXPERTS
    acc = tl.zeros([ROUTE_ROWS, BLOCK_E], tl.float32)
    if PREFETCH_W:
        ws = ()  # one [BE, BK] tile per chunk, all loads issued before any wait
        for c in tl.static_range(0, HIDDEN, BLOCK_K):
            kk = c + tl.arange(0, BLOCK_K)
            ws = ws + (tl.load(rw_ptr + e[None, :, None] * HIDDEN + kk[None, None, :],
                               mask=em[None, :, None] & (kk < HIDDEN)[None, None, :],
                               other=0.0),)
    if UNROLL_K and not COUNT_READY:
        # one poll reads every chunk (unrolled, no reduction inside: the loads can all be in
        # flight together); products accumulate per lane, reduced once at the end (another
        # summation order than the chunked path: the router-logits tolerance row covers both);
        # a poll that saw a NaN starts over
        ok = tl.full([], 0, tl.int32)
        polls = tl.full([], 0, tl.int32)
        acc3 = tl.zeros([ROUTE_ROWS, BLOCK_E, BLOCK_K], tl.float32)
        while (ok == 0) & (polls < max_polls):
            acc3 = tl.zeros([ROUTE_ROWS, BLOCK_E, BLOCK_K], tl.float32)
            bad = tl.zeros([ROUTE_ROWS, 1, BLOCK_K], tl.int32)
            for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
                r = tl.load(_rin_ptrs(rin_ptr, rows, k0, HIDDEN, BLOCK_K),
                            mask=_rin_mask(rl, k0, HIDDEN, BLOCK_K), other=0.0, volatile=True)
                bad = bad | (r != r).to(tl.int32)
                if PREFETCH_W:
                    w = ws[k0 // BLOCK_K]
                else:
                    w = _load_w(rw_ptr, e, em, k0, HIDDEN, BLOCK_K)
                acc3 += r * w
            ok = (tl.max(bad, axis=None) == 0).to(tl.int32)
            polls += 1
        stamp(trace_ptr, pid, 8, TRACE)
        acc = tl.sum(acc3, axis=2)
    elif PREFETCH_W or COUNT_READY:  # unrolled over the chunks (ws is indexed per chunk)
        ok = tl.full([], 1, tl.int32)
        if COUNT_READY:
            ok = wait_count(ready_ptr, n_rows, max_polls)
            stamp(trace_ptr, pid, 8, TRACE)
            rs = ()  # every chunk's loads issued before the first product: one L2 round trip
            for c in tl.static_range(0, HIDDEN, BLOCK_K):
                rs = rs + (tl.load(_rin_ptrs(rin_ptr, rows, c, HIDDEN, BLOCK_K),
                                   mask=_rin_mask(rl, c, HIDDEN, BLOCK_K), other=0.0,
                                   volatile=True),)
        for c in tl.static_range(0, HIDDEN, BLOCK_K):
            if COUNT_READY:
                r = rs[c // BLOCK_K]
            else:
                r, got = wait_ready(_rin_ptrs(rin_ptr, rows, c, HIDDEN, BLOCK_K),
                                    _rin_mask(rl, c, HIDDEN, BLOCK_K), max_polls)
                ok = ok & got
                stamp(trace_ptr, pid, 8, TRACE)  # the last chunk's stamp stays
            if PREFETCH_W:
                w = ws[c // BLOCK_K]
            else:
                w = _load_w(rw_ptr, e, em, c, HIDDEN, BLOCK_K)
            acc += tl.sum(r * w, axis=2)
    else:
        ok = tl.full([], 1, tl.int32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            r, got = wait_ready(_rin_ptrs(rin_ptr, rows, k0, HIDDEN, BLOCK_K),
                                _rin_mask(rl, k0, HIDDEN, BLOCK_K), max_polls)
            ok = ok & got
            stamp(trace_ptr, pid, 8, TRACE)  # the last chunk's stamp stays
            acc += tl.sum(r * _load_w(rw_ptr, e, em, k0, HIDDEN, BLOCK_K), axis=2)
    tl.store(flag_ptr, 1, mask=ok == 0)
    acc = tl.where(ok != 0, acc, float("nan"))
    stamp(trace_ptr, pid, 1, TRACE)
    _publish(acc, e, em, rows, rl, logit_ptr, ids_ptr, wts_ptr, rin_ptr, cnt_ptr, flag_ptr,
             stride_ir, stride_ik, stride_wr, stride_wk, n_router, HIDDEN, EXPERTS, BLOCK_EALL,
             TOP_K, BLOCK_TOPK, BLOCK_K, not COUNT_READY, TOPK, trace_ptr, pid, TRACE,
             ready_ptr, COUNT_READY)


@triton.jit
def _route_kernel(
    x_ptr, rw_ptr, logit_ptr, cnt_ptr, ids_ptr, wts_ptr, flag_ptr, n_live_ptr,
    stride_x, stride_ir, stride_wr, n_router, n_rows,
    HIDDEN: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_EALL: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_TOPK: tl.constexpr, ROUTE_ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """A standalone route of a ready x [R ≤ ROUTE_ROWS, H] (the draft layer's f_in): program j
    computes experts [j·BLOCK_E, (j+1)·BLOCK_E) for every live row, so the router weight is
    read once across the grid instead of once per row; the last program to finish (acq_rel
    counter) routes all rows with the folded router's `_route_finish`. Program 0 also marks the
    padding rows [n, n_rows) of ids / weights (−1 / NaN), so the outputs need no fill launch."""
    pdl_enter(PDL)
    j = tl.program_id(0)
    n = tl.load(n_live_ptr)
    rows = tl.arange(0, ROUTE_ROWS)
    rl = rows < n
    if j == 0:
        kc = tl.arange(0, BLOCK_TOPK)
        pad = (~rl & (rows < n_rows))[:, None] & (kc < TOP_K)[None, :]
        tl.store(ids_ptr + rows[:, None] * stride_ir + kc[None, :],
                 tl.full([ROUTE_ROWS, BLOCK_TOPK], -1, tl.int32), mask=pad)
        tl.store(wts_ptr + rows[:, None] * stride_wr + kc[None, :],
                 tl.full([ROUTE_ROWS, BLOCK_TOPK], float("nan"), tl.float32), mask=pad)
    e = j * BLOCK_E + tl.arange(0, BLOCK_E)
    em = e < EXPERTS
    acc = tl.zeros([ROUTE_ROWS, BLOCK_E], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < HIDDEN
        r = tl.load(x_ptr + rows[:, None, None] * stride_x + kk[None, None, :],
                    mask=rl[:, None, None] & km[None, None, :],
                    other=0.0).to(tl.float32)  # [RR, 1, BK]
        acc += tl.sum(r * _load_w(rw_ptr, e, em, k0, HIDDEN, BLOCK_K).to(tl.float32), axis=2)
    _publish(acc, e, em, rows, rl, logit_ptr, ids_ptr, wts_ptr, logit_ptr, cnt_ptr, flag_ptr,
             stride_ir, 1, stride_wr, 1, n_router, HIDDEN, EXPERTS, BLOCK_EALL, TOP_K,
             BLOCK_TOPK, BLOCK_K, False)


@dataclass(frozen=True)
class RouteLaunch:
    num_warps: int = 8
    route_rows: int = 8  # rows per program; fixed so padded and exact widths match bits
    block_e: int = 2  # experts per program
    block_k: int = 1024  # hidden columns per step


def route_launch(hidden: int, experts: int) -> RouteLaunch:
    """The folded router's tuned blocks (kernels/tails_launch.py tail_launch; E = 256: 128 programs
    of 2 experts, 3 steps of 1024 columns at H 3072); small E: 8 experts × 128 columns."""
    if experts >= 64:
        return RouteLaunch(block_e=2, block_k=min(1024, triton.next_power_of_2(hidden)))
    return RouteLaunch(block_e=8, block_k=min(128, triton.next_power_of_2(hidden)))


@dataclass(frozen=True)
class RouteScratch:
    """A standalone route's state between launches: the logits of the live rows, the arrival
    counter (0 between launches: the last program resets it) and a flag raised when a live
    row's logits are not finite (that row gets ids −1 and NaN weights)."""

    logits: torch.Tensor  # [route_rows, E] fp32
    counter: torch.Tensor  # [1] int32
    flag: torch.Tensor  # [1] int32

    @classmethod
    def create(cls, experts: int, device, route_rows: int = 8) -> RouteScratch:
        return cls(torch.full((route_rows, experts), float("nan"), dtype=torch.float32,
                              device=device),
                   torch.zeros(1, dtype=torch.int32, device=device),
                   torch.zeros(1, dtype=torch.int32, device=device))

    def reset(self) -> None:
        """After a failed launch (device synchronized): counter 0, flag down."""
        self.counter.zero_()
        self.flag.zero_()


@dataclass(frozen=True)
class RouterScratch:
    """Handoff from row programs to router programs (see the module docstring)."""

    r_in: torch.Tensor  # [route_rows, H] fp32; NaN readiness: all NaN between launches
    logits: torch.Tensor  # [route_rows, E] fp32, the last launch's logits (live rows)
    counter: torch.Tensor  # [1] int32 router arrivals, 0 between launches
    ready: torch.Tensor  # [1] int32 row programs done (TailLaunch.count_ready), 0 between

    @classmethod
    def create(cls, hidden: int, experts: int, device, route_rows: int = 8) -> RouterScratch:
        return cls(
            torch.full((route_rows, hidden), float("nan"), dtype=torch.float32, device=device),
            torch.full((route_rows, experts), float("nan"), dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )

    def reset(self) -> None:
        """After a failure flag (device synchronized): restore the invariant."""
        self.r_in.fill_(float("nan"))
        self.counter.zero_()
        self.ready.zero_()
