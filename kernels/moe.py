"""Block-FP8 MoE for 1–16 rows (target: 1–8 live rows of a decode round). Twin:
reference/twins/moe.py `moe_fp8_ref` (stages `moe_gate_up_fp8_ref`, `moe_down_fp8_ref`).

Dimension letters: R rows in the padded buffer (≤ 16), n live rows (device scalar), H hidden,
E experts, K top-k, I expert intermediate, S = R·K slots (slot r·K + k is row r's k-th expert),
BN channels per program, BR = 16 rows on the MMA's narrow side.

Checkpoint layout: fc [E, 2I, H] E4M3 (rows [0, I) gate, [I, 2I) up), fc_scale_inv
[E, ⌈2I/128⌉, ⌈H/128⌉]; proj [E, H, I], proj_scale_inv [E, ⌈H/128⌉, ⌈I/128⌉]. Scale blocks may
straddle the gate/up boundary (I = 192 per TP8 rank) and be partial (I = 64): every weight row
looks up its own block row, n // 128.

Launch configuration (tiles, warps, K split; pinned per shape and device type):
kernels/moe_launch.py.

Launches (all grids fixed by R, so one CUDA graph serves every n ≤ R; n is read on the device):
  1. act-quant x → E4M3 + scales per row per 128 columns           (kernels/fp8.py; in the
     runtime the attention tail writes it, kernels/tails.py)
  2. gate/up partials: grid (S, ⌈I/BN⌉, KS). Program (s, t, j) leads slot s's expert e unless an
     earlier live slot routes to e too, so each distinct expert is read once; it computes tile
     t of gate and of up over K split j (hidden blocks [j·KB, (j+1)·KB) of 128 columns) for
     every live row routed to e and writes both, FP32, to part[j] of each such slot. The K
     split gives KS × more programs, each streaming KS × fewer bytes: a program streaming a
     whole BN-channel tile over H (2·32·3072 B) is latency-bound (H200, gate/up + SiLU without
     → with the split: 26.4 → 17.7 µs at 6 rows with 35 distinct experts, 25.6 → 12.3 µs at 1
     row; reports/benchmarks/h200-2026-12-01/session9/exp_router_moe_call2.log).
  3. SiLU: a = SiLU(Σ_j gate_j)·(Σ_j up_j), partials added in j order (fixed: the same bits
     every call), then quantized per slot per 128 columns for down (or stored FP32 by the
     stage-1 API). The 128-column groups span several channel tiles, so the amax is only known
     once every tile and split is written: its own launch, grid (S,). MoeLaunch.fold_silu runs
     it inside launch 2 instead, by the last of an expert's programs to arrive on its counter
     (`_fold_silu`, a MoeScratch the op table keeps): the same operations in the same order,
     the same bits, one launch fewer — and slower on the H200 (kernels/moe_launch.py), so off.
     MoeLaunch.silu_in_down instead recomputes it in launch 4: each down program sums its
     rows' partials for the 128-column groups of its K loop and quantizes them (`_silu_cols`,
     transposed); no counters, no program waits for another.
  4+5. MoeLaunch.down_rows: one row-major launch, grid (R, ⌈H/BN⌉): program (r, t) runs tile t
     of row r's K experts' down GEMMs in k order and sums them in registers
     (`_moe_down_rows_kernel`): no y, no combine launch, no counters, the same bits — but no
     expert dedup (an expert shared by rows is streamed by each; L2 serves the repeats).
  4. down: grid (S, ⌈H/BN⌉), same expert dedup; writes each slot's FP32 expert output [H].
  5. combine: out[r] = Σ_k w[r, k] · y[r·K + k], FP32 in k order, one rounding; grid
     (R, ⌈H/BH⌉). MoeLaunch.fold_combine runs it inside launch 4, by the K-th down program to
     arrive on the counter of (row, hidden tile) (`_fold_combine`); both run `_combine_row`:
     the same bits. Off, as fold_silu.
The weight tile is the MMA's wide side (BN × 128) and the ≤ 16 rows its narrow side, so the
programs stream weights while rows ride along; slots, tiles and splits spread the work over all
SMs. E4M3 tiles are widened to FP16 (exact) before tl.dot: Hopper's FP8 MMA accumulates with reduced
precision (≈14 bits, DeepSeek-V3 report §3.3.2; Triton's sm_90 default allows it for all of K),
while FP16 MMA accumulates in FP32. The kernels are memory-bound, so the widening is free and the
GEMMs stay at FP32 accuracy; each 128-wide K block is then scaled and added in FP32.
Rows ≥ n and their slots are never read or written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import check_quantized, check_tensor, live_count
from kernels.fp8 import E4M3, bf16_rne, blocks, quantize_act, quantize_cols, quantize_groups
from kernels.launch import launch_opts, pdl_enter, prefetch_l2
from kernels.moe_launch import MoeLaunch, moe_launch
from kernels.timeline import check_trace, stamp, stamp_at, stamp_start
from kernels.twin import twin
from reference.twins import moe as _twins

BLOCK_R = 16  # rows on the narrow side of the MMA (tl.dot needs >= 16)
MAX_SLOTS = BLOCK_R * 16  # R·K slots at most (R ≤ 16 rows, top-k ≤ 16)
MAX_TILES = 1024  # down's hidden tiles the folded combine can count (H ≤ 1024 · down_block_n)
COUNTERS = MAX_SLOTS + BLOCK_R * MAX_TILES  # MoeScratch: SiLU's, then the combine's


# --- kernels ---------------------------------------------------------------------------------


@triton.jit
def _slot_lead(ids_ptr, n_live, stride_ir, stride_ik, K: tl.constexpr, S_PAD: tl.constexpr):
    """For slot s = program_id(0): its expert e, and lead = s is live and no earlier slot routes
    to e (earlier slots of live rows are live). Only leads go on to `_expert_hits`: the other
    programs exit after these two loads."""
    s = tl.program_id(0)
    live = s // K < n_live
    e = tl.load(ids_ptr + (s // K) * stride_ir + (s % K) * stride_ik, mask=live, other=-1)
    prev = tl.arange(0, S_PAD)
    pe = tl.load(ids_ptr + (prev // K) * stride_ir + (prev % K) * stride_ik,
                 mask=(prev < s) & live, other=-1)
    return e, live & (tl.sum((pe == e).to(tl.int32), axis=0) == 0)


@triton.jit
def _distinct_experts(ids_ptr, n_live, stride_ir, stride_ik, K: tl.constexpr,
                      S_PAD: tl.constexpr):
    """→ (ids [S_PAD], rank [S_PAD], n): every live slot's expert (-1 past them), each slot's
    rank among the lead slots (a lead: the first live slot routing to its expert; 0, 1, … in
    slot order, -1 for the others) and the number of distinct experts n. The compact gate/up
    (MoeLaunch.gate_up_compact) gives expert rank d the work the slot grid gives the d-th lead
    slot (`_slot_lead`)."""
    s = tl.arange(0, S_PAD)
    live = s // K < n_live
    ids = tl.load(ids_ptr + (s // K) * stride_ir + (s % K) * stride_ik, mask=live, other=-1)
    before = (s[None, :] < s[:, None]) & (ids[None, :] == ids[:, None])  # [S_PAD, S_PAD]
    lead = live & (tl.sum(before.to(tl.int32), axis=1) == 0)
    rank = tl.cumsum(lead.to(tl.int32), axis=0) - 1
    return ids, tl.where(lead, rank, -1), tl.sum(lead.to(tl.int32), axis=0)


@triton.jit
def _expert_hits(ids_ptr, e, n_live, stride_ir, stride_ik,
                 K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """hit [BR, K_PAD]: live row r's k-th slot routes to expert e."""
    rows = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, K_PAD)
    valid = (rows[:, None] < n_live) & (ks[None, :] < K)  # [BR, K_PAD]
    rid = tl.load(ids_ptr + rows[:, None] * stride_ir + ks[None, :] * stride_ik, mask=valid,
                  other=-1)
    return (rid == e) & valid


@triton.jit
def _slot_route_early(ids_ptr, n_live, R, stride_ir, stride_ik, K: tl.constexpr,
                      K_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """`_slot_lead` and `_expert_hits` at once (MoeLaunch.early_loads) → (e, lead, hit): the
    ids of all R buffer rows are loaded without waiting for n_live (padding rows' ids are read,
    never used: their slots are not live and their rows not valid), so the weight addresses
    wait for one round trip, not for n_live, then the ids, then the ids again. The same e, lead
    and hit for every program that goes on."""
    s = tl.program_id(0)  # < R·K: a slot of the buffer
    e = tl.load(ids_ptr + (s // K) * stride_ir + (s % K) * stride_ik)
    rows = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, K_PAD)
    inbuf = (rows[:, None] < R) & (ks[None, :] < K)  # [BR, K_PAD]
    rid = tl.load(ids_ptr + rows[:, None] * stride_ir + ks[None, :] * stride_ik, mask=inbuf,
                  other=-1)
    slot = rows[:, None] * K + ks[None, :]
    earlier = tl.sum(((slot < s) & inbuf & (rid == e)).to(tl.int32))
    lead = (s // K < n_live) & (earlier == 0)  # slots before a live one are live
    return e, lead, (rid == e) & inbuf & (rows[:, None] < n_live)


@triton.jit
def _moe_gate_up_kernel(
    xq_ptr, xs_ptr, ids_ptr, n_live_ptr, fc_ptr, fcs_ptr, p_ptr,
    cnt_ptr, a_ptr, aq_ptr, as_ptr,
    R, H: tl.constexpr, I: tl.constexpr,
    stride_xqr, stride_xsr, stride_ir, stride_ik,
    stride_fe, stride_fn, stride_fk, stride_se, stride_sn, stride_sk, stride_pj, stride_ps,
    stride_ar, stride_aqr, stride_asr,
    K: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, K_BLOCKS: tl.constexpr,
    FOLD: tl.constexpr, KS: tl.constexpr, GROUPS: tl.constexpr, QUANT: tl.constexpr,
    HOIST: tl.constexpr, EARLY: tl.constexpr, trace_ptr, TRACE: tl.constexpr, PDL: tl.constexpr,
    COMPACT: tl.constexpr,
):
    """Launch 2: program (slot, channel tile, K split). TRACE (`moe_fp8(gate_up_trace=…)`): at
    pid (slot·T + tile)·KS + split, slot 0 its start (and SM), 1 past the lead exit (an expert's
    first live slot goes on), 2 + b after hidden block b's products (slot 9: the last block's
    when the split has more than 8), 10 after its partials are stored (kernels/timeline.py).
    COMPACT (MoeLaunch.gate_up_compact): a 1-D grid of the same size whose program w takes work
    item (expert rank d, tile, split) = (w // (T·KS), w // KS % T, w % KS) — the slot-grid
    program of the rank-d lead slot, the same loads and products: the same bits — while w <
    n·T·KS for the n distinct experts: the programs with work are the grid's first, whatever
    the routing. Stamped at pid w likewise (slot 1: w has an item). No FOLD or EARLY."""
    pdl_enter(PDL)
    if COMPACT:
        w = tl.program_id(0)
        stamp_start(trace_ptr, w, TRACE)
        n_live = tl.minimum(tl.load(n_live_ptr), R)
        ids, rank, n_e = _distinct_experts(ids_ptr, n_live, stride_ir, stride_ik, K, S_PAD)
        T = (I + BLOCK_N - 1) // BLOCK_N  # channel tiles
        if w >= n_e * T * KS:
            return
        stamp(trace_ptr, w, 1, TRACE)
        e = tl.sum(tl.where(rank == w // (T * KS), ids, 0), axis=0)  # one slot has that rank
        hit = _expert_hits(ids_ptr, e, n_live, stride_ir, stride_ik, K, K_PAD, BLOCK_R)
        _gate_up_item(xq_ptr, xs_ptr, fc_ptr, fcs_ptr, p_ptr, e, hit, w // KS % T, w % KS,
                      stride_xqr, stride_xsr, stride_fe, stride_fn, stride_fk, stride_se,
                      stride_sn, stride_sk, stride_pj, stride_ps, H, I, K, K_PAD, BLOCK_N,
                      BLOCK_R, K_BLOCKS, HOIST, trace_ptr, w, TRACE)
        stamp(trace_ptr, w, 10, TRACE)
        return
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * KS + tl.program_id(2)
    stamp_start(trace_ptr, pid, TRACE)
    n_live = tl.minimum(tl.load(n_live_ptr), R)
    if EARLY:
        e, lead, hit = _slot_route_early(ids_ptr, n_live, R, stride_ir, stride_ik, K, K_PAD,
                                         BLOCK_R)
    else:
        e, lead = _slot_lead(ids_ptr, n_live, stride_ir, stride_ik, K, S_PAD)
    if lead == 0:
        return
    stamp(trace_ptr, pid, 1, TRACE)
    if not EARLY:
        hit = _expert_hits(ids_ptr, e, n_live, stride_ir, stride_ik, K, K_PAD, BLOCK_R)
    _gate_up_item(xq_ptr, xs_ptr, fc_ptr, fcs_ptr, p_ptr, e, hit, tl.program_id(1),
                  tl.program_id(2), stride_xqr, stride_xsr, stride_fe, stride_fn, stride_fk,
                  stride_se, stride_sn, stride_sk, stride_pj, stride_ps, H, I, K, K_PAD,
                  BLOCK_N, BLOCK_R, K_BLOCKS, HOIST, trace_ptr, pid, TRACE)
    stamp(trace_ptr, pid, 10, TRACE)
    if FOLD:
        _fold_silu(p_ptr, cnt_ptr, a_ptr, aq_ptr, as_ptr, ids_ptr, e, n_live, stride_ir,
                   stride_ik, stride_pj, stride_ps, stride_ar, stride_aqr, stride_asr,
                   I, K, K_PAD, KS, GROUPS, QUANT, BLOCK_R)


@triton.jit
def _gate_up_item(xq_ptr, xs_ptr, fc_ptr, fcs_ptr, p_ptr, e, hit, t, j, stride_xqr, stride_xsr,
                  stride_fe, stride_fn, stride_fk, stride_se, stride_sn, stride_sk, stride_pj,
                  stride_ps, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
                  K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  K_BLOCKS: tl.constexpr, HOIST: tl.constexpr, trace_ptr, pid,
                  TRACE: tl.constexpr):
    """Expert e's channel tile t, K split j (hit [BR, K_PAD]: the live slots routed to e): the
    gate and up partials of every such slot."""
    rows = tl.arange(0, BLOCK_R)
    uses = tl.max(hit.to(tl.int32), axis=1) > 0  # [BR] rows routed to e
    c = t * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] intermediate channels
    cm = c < I
    w_e = fc_ptr + e.to(tl.int64) * stride_fe
    s_e = fcs_ptr + e.to(tl.int64) * stride_se
    acc_g = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    # K split j: hidden blocks [j·K_BLOCKS, (j+1)·K_BLOCKS)
    acc_g, acc_u = _gate_up_loop(acc_g, acc_u, xq_ptr, xs_ptr, w_e, s_e, rows, uses, c, cm, j,
                                 stride_xqr, stride_xsr, stride_fn, stride_fk, stride_sn,
                                 stride_sk, H, I, K_BLOCKS, HOIST, trace_ptr, pid, TRACE)
    # every slot (r, k) routed to e gets the row's partials: part[j, slot, c] gate, [.., I + c] up
    slot = rows[:, None] * K + tl.arange(0, K_PAD)[None, :]  # [BR, K_PAD]
    dst = p_ptr + j * stride_pj + slot[None, :, :] * stride_ps + c[:, None, None]  # [BN, BR, KP]
    sm = cm[:, None, None] & hit[None, :, :]
    tl.store(dst, acc_g[:, :, None], mask=sm)
    tl.store(dst + I, acc_u[:, :, None], mask=sm)


@triton.jit
def _gate_up_loop(acc_g, acc_u, xq_ptr, xs_ptr, w_e, s_e, rows, uses, c, cm, j, stride_xqr,
                  stride_xsr, stride_fn, stride_fk, stride_sn, stride_sk, H: tl.constexpr,
                  I: tl.constexpr, K_BLOCKS: tl.constexpr, HOIST: tl.constexpr, trace_ptr, pid,
                  TRACE: tl.constexpr):
    """acc_g, acc_u [BN, BR] += gate and up tiles c of expert e (w_e, s_e) times the routed
    rows' activations over K split j's hidden blocks, each block scaled in FP32.
    HOIST (MoeLaunch.gate_up_hoist): the split's activation scales and gate and up weight scales
    are loaded before the loop and picked per block inside it (one-hot sums of positive scales:
    exact), so the loop waits only on the tiles the pipeliner carries through cp.async (see
    `_down_rows_hoisted`); the same values in the same operations: the same bits."""
    if HOIST:
        bs = tl.arange(0, triton.next_power_of_2(K_BLOCKS))  # [KB] blocks of this split
        k0s = (j * K_BLOCKS + bs) * 128  # first hidden column of each block
        bv = (bs < K_BLOCKS) & (k0s < H)  # the last split may be short
        xs_all = tl.load(xs_ptr + rows[:, None] * stride_xsr + (k0s // 128)[None, :],
                         mask=uses[:, None] & bv[None, :], other=0.0)  # [BR, KB]
        sv = bv[:, None] & cm[None, :]
        sg_all = tl.load(s_e + (c // 128)[None, :] * stride_sn + (k0s // 128)[:, None]
                         * stride_sk, mask=sv, other=0.0)  # [KB, BN]
        su_all = tl.load(s_e + ((I + c) // 128)[None, :] * stride_sn + (k0s // 128)[:, None]
                         * stride_sk, mask=sv, other=0.0)  # [KB, BN]
    for b in range(0, K_BLOCKS):
        k0 = (j * K_BLOCKS + b) * 128
        hc = k0 + tl.arange(0, 128)  # [128] hidden columns of this scale block
        km = hc < H
        bm = k0 < H  # the last split may be short
        xq = tl.load(xq_ptr + rows[None, :] * stride_xqr + hc[:, None],
                     mask=km[:, None] & uses[None, :], other=0.0)  # [128, BR] E4M3
        wm = cm[:, None] & km[None, :]
        wg = tl.load(w_e + c[:, None] * stride_fn + hc[None, :] * stride_fk, mask=wm, other=0.0)
        wu = tl.load(w_e + (I + c)[:, None] * stride_fn + hc[None, :] * stride_fk, mask=wm,
                     other=0.0)  # [BN, 128] E4M3
        if HOIST:
            xs = tl.sum(tl.where((bs == b)[None, :], xs_all, 0.0), axis=1)  # [BR]
            sg = tl.sum(tl.where((bs == b)[:, None], sg_all, 0.0), axis=0)  # [BN]
            su = tl.sum(tl.where((bs == b)[:, None], su_all, 0.0), axis=0)
        else:
            xs = tl.load(xs_ptr + rows * stride_xsr + k0 // 128, mask=uses & bm,
                         other=0.0)  # [BR]
            sg = tl.load(s_e + (c // 128) * stride_sn + (k0 // 128) * stride_sk, mask=cm & bm,
                         other=0.0)
            su = tl.load(s_e + ((I + c) // 128) * stride_sn + (k0 // 128) * stride_sk,
                         mask=cm & bm, other=0.0)  # [BN]
        xh = xq.to(tl.float16)
        acc_g += tl.dot(wg.to(tl.float16), xh) * (sg[:, None] * xs[None, :])
        acc_u += tl.dot(wu.to(tl.float16), xh) * (su[:, None] * xs[None, :])
        stamp_at(trace_ptr, pid, tl.minimum(2 + b, 9), TRACE)
    return acc_g, acc_u


@triton.jit
def _fold_silu(p_ptr, cnt_ptr, a_ptr, aq_ptr, as_ptr, ids_ptr, e, n_live, stride_ir, stride_ik,
               stride_pj, stride_ps, stride_ar, stride_aqr, stride_asr,
               I: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, KS: tl.constexpr,
               GROUPS: tl.constexpr, QUANT: tl.constexpr, BLOCK_R: tl.constexpr):
    """Launch 3 folded into launch 2: the lead slot's programs (channel tiles × K splits) arrive
    on its counter cnt[s] after their partials are stored; the last to arrive runs `_silu_slot`
    for every live row's slot routed to e and puts cnt[s] back to 0 (the invariant between
    launches: all counters 0; launches of one stream never overlap)."""
    s = tl.program_id(0)
    arrivals = tl.num_programs(1) * tl.num_programs(2)
    # release: every thread's partials are stored before the counter moves
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + s, 1, sem="acq_rel", scope="gpu")
    if done == arrivals - 1:
        ks = tl.arange(0, K_PAD)
        for r in range(0, BLOCK_R):  # rows ≥ n_live find no slot
            rid = tl.load(ids_ptr + r * stride_ir + ks * stride_ik, mask=(ks < K) & (r < n_live),
                          other=-1)
            k = tl.min(tl.where(rid == e, ks, K_PAD), axis=0)  # ids are distinct within a row
            if k < K:
                _silu_slot(p_ptr, r * K + k, a_ptr, aq_ptr, as_ptr, stride_pj, stride_ps,
                           stride_ar, stride_aqr, stride_asr, I, KS, GROUPS, QUANT, True)
        tl.store(cnt_ptr + s, 0)


@triton.jit
def _silu_slot(p_ptr, s, a_ptr, aq_ptr, as_ptr, stride_pj, stride_ps, stride_ar, stride_aqr,
               stride_asr, I: tl.constexpr, KS: tl.constexpr, GROUPS: tl.constexpr,
               QUANT: tl.constexpr, VOLATILE: tl.constexpr):
    """Slot s: a = SiLU(Σ_j gate_j)·(Σ_j up_j) over the KS partials in j order; QUANT: a
    quantized per 128 columns (quantize_act's operations) → aq, as; else a, FP32. VOLATILE: the
    partials were written by other programs of this launch (read past L1)."""
    grp = tl.arange(0, GROUPS)
    col = grp[:, None] * 128 + tl.arange(0, 128)[None, :]  # [G, 128]
    m = col < I
    g = tl.zeros((GROUPS, 128), tl.float32)
    u = tl.zeros((GROUPS, 128), tl.float32)
    for j in tl.static_range(KS):
        src = p_ptr + j * stride_pj + s * stride_ps + col
        g += tl.load(src, mask=m, other=0.0, volatile=VOLATILE)
        u += tl.load(src + I, mask=m, other=0.0, volatile=VOLATILE)
    a = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
    if QUANT:
        q, sc = quantize_groups(a)
        tl.store(aq_ptr + s * stride_aqr + col, q, mask=m)
        tl.store(as_ptr + s * stride_asr + grp, sc, mask=grp * 128 < I)
    else:
        tl.store(a_ptr + s * stride_ar + col, a, mask=m)


@triton.jit
def _moe_silu_kernel(
    p_ptr, n_live_ptr, a_ptr, aq_ptr, as_ptr, ids_ptr, proj_ptr, R,
    stride_pj, stride_ps, stride_ar, stride_aqr, stride_asr, stride_ir, stride_ik, stride_pe,
    I: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, GROUPS: tl.constexpr,
    QUANT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = 0,
    LINES: tl.constexpr = 1,
):
    """Launch 3 unfolded: slot s = program_id(0) through `_silu_slot`. PREFETCH > 0
    (MoeLaunch.silu_prefetch, compiled kernels only): a slot among its row's first PREFETCH
    experts first asks L2 for that expert's down weights, proj[e] (LINES 128-byte lines,
    contiguous), so launch 4's first expert steps read L2, not HBM — a hint: no bit changes."""
    pdl_enter(PDL)
    s = tl.program_id(0)
    if s >= tl.minimum(tl.load(n_live_ptr), R) * K:
        return
    if PREFETCH > 0:
        if s % K < PREFETCH:
            e = tl.load(ids_ptr + (s // K) * stride_ir + (s % K) * stride_ik)
            base = proj_ptr + e.to(tl.int64) * stride_pe
            for c in range(0, LINES, 1024):
                line = c + tl.arange(0, 1024)  # [1024] lines of proj[e]
                prefetch_l2(base + line.to(tl.int64) * 128, line < LINES, base)
    _silu_slot(p_ptr, s, a_ptr, aq_ptr, as_ptr, stride_pj, stride_ps, stride_ar, stride_aqr,
               stride_asr, I, KS, GROUPS, QUANT, False)


@triton.jit
def _moe_down_kernel(
    aq_ptr, as_ptr, ids_ptr, n_live_ptr, proj_ptr, ps_ptr, y_ptr,
    w_ptr, out_ptr, cnt_ptr, gu_ptr,
    R, H: tl.constexpr, I: tl.constexpr,
    stride_aqr, stride_asr, stride_ir, stride_ik,
    stride_pe, stride_pn, stride_pk, stride_se, stride_sn, stride_sk, stride_yr,
    stride_wr, stride_wk, stride_or, stride_gj, stride_gs,
    K: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, FOLD: tl.constexpr,
    SILU: tl.constexpr, KS: tl.constexpr, OUT_BF16: tl.constexpr, EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """Launch 4 on aq, sa (launch 3's output) — or, SILU, on the gate/up partials gu [KS, S, 2I]
    themselves: each program computes its rows' SiLU(gate)·up and quantization for every
    128-column group of its K loop (`_silu_cols`, the operations of `_silu_slot`), so launch 3
    does not run. Every hidden tile of an expert recomputes the same few values from L2; no
    program waits for another."""
    pdl_enter(PDL)
    n_live = tl.minimum(tl.load(n_live_ptr), R)
    if EARLY:
        e, lead, hit = _slot_route_early(ids_ptr, n_live, R, stride_ir, stride_ik, K, K_PAD,
                                         BLOCK_R)
    else:
        e, lead = _slot_lead(ids_ptr, n_live, stride_ir, stride_ik, K, S_PAD)
    if lead == 0:
        return
    if not EARLY:
        hit = _expert_hits(ids_ptr, e, n_live, stride_ir, stride_ik, K, K_PAD, BLOCK_R)
    rows = tl.arange(0, BLOCK_R)  # [BR]
    slot = rows[:, None] * K + tl.arange(0, K_PAD)[None, :]  # [BR, K_PAD]
    # one slot of row r routed to e (all of them hold the same intermediate), −1 if none
    src = tl.max(tl.where(hit, slot, -1), axis=1)  # [BR]
    uses = src >= 0
    h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden channels
    hm = h < H
    w_e = proj_ptr + e.to(tl.int64) * stride_pe
    s_e = ps_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for i0 in range(0, I, 128):
        acc = _down_block(acc, i0, aq_ptr, as_ptr, gu_ptr, src, uses, w_e, s_e, h, hm,
                          stride_aqr, stride_asr, stride_gj, stride_gs, stride_pn, stride_pk,
                          stride_sn, stride_sk, I, KS, SILU)
    tl.store(y_ptr + slot[None, :, :] * stride_yr + h[:, None, None], acc[:, :, None],
             mask=hm[:, None, None] & hit[None, :, :])
    if FOLD:
        _fold_combine(y_ptr, w_ptr, out_ptr, cnt_ptr, ids_ptr, e, n_live, h, hm, stride_yr,
                      stride_wr, stride_wk, stride_or, stride_ir, stride_ik, K, K_PAD, BLOCK_R,
                      OUT_BF16)


@triton.jit
def _down_block(acc, i0, aq_ptr, as_ptr, gu_ptr, src, uses, w_e, s_e, h, hm,
                stride_aqr, stride_asr, stride_gj, stride_gs, stride_pn, stride_pk,
                stride_sn, stride_sk, I: tl.constexpr, KS: tl.constexpr, SILU: tl.constexpr):
    """One 128-column K block of down: acc [BN, BR] += W_e[h, block] · operand, scaled per
    block. Column r of the operand is slot src[r]'s intermediate (rows with uses[r] only):
    from aq, sa, or (SILU) made from the gate/up partials."""
    ii = i0 + tl.arange(0, 128)
    im = ii < I
    if SILU:
        aq, sa = _silu_cols(gu_ptr, src, uses, ii, im, stride_gj, stride_gs, I, KS)
    else:
        aq = _down_operand(aq_ptr, src, uses, ii, im, stride_aqr)
        sa = tl.load(as_ptr + src * stride_asr + i0 // 128, mask=uses, other=0.0)
    w = _down_weight(w_e, h, hm, ii, im, stride_pn, stride_pk)
    sw = tl.load(s_e + (h // 128) * stride_sn + (i0 // 128) * stride_sk, mask=hm, other=0.0)
    return acc + tl.dot(w.to(tl.float16), aq.to(tl.float16)) * (sw[:, None] * sa[None, :])


@triton.jit
def _down_operand(aq_ptr, src, uses, ii, im, stride_aqr):
    """The MMA's narrow side for K block ii: column r holds slot src[r]'s E4M3 intermediate
    (rows with uses[r]), 0 elsewhere → [128, BR]."""
    return tl.load(aq_ptr + src[None, :] * stride_aqr + ii[:, None],
                   mask=im[:, None] & uses[None, :], other=0.0)


@triton.jit
def _down_weight(w_e, h, hm, ii, im, stride_pn, stride_pk):
    """Expert w_e's down weight tile, hidden channels h × K block ii → [BN, 128] E4M3."""
    return tl.load(w_e + h[:, None] * stride_pn + ii[None, :] * stride_pk,
                   mask=hm[:, None] & im[None, :], other=0.0)


@triton.jit
def _silu_cols(gu_ptr, src, uses, ii, im, stride_gj, stride_gs, I: tl.constexpr,
               KS: tl.constexpr):
    """One 128-column group ii of the rows' intermediate, transposed: for each row (column of
    the result) its slot src's a = SiLU(Σ_j gate_j)·(Σ_j up_j), partials added in j order, then
    quantized — `_silu_slot`'s operations on [128, BR] instead of [G, 128], so the same bits
    → (E4M3 [128, BR], scales [BR]). Rows not routed here: a = 0, scale 1 (never stored)."""
    m = im[:, None] & uses[None, :]
    g = tl.zeros((ii.shape[0], src.shape[0]), tl.float32)
    u = tl.zeros((ii.shape[0], src.shape[0]), tl.float32)
    for j in tl.static_range(KS):
        p = gu_ptr + j * stride_gj + src[None, :] * stride_gs + ii[:, None]  # [128, BR]
        g += tl.load(p, mask=m, other=0.0)
        u += tl.load(p + I, mask=m, other=0.0)
    a = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
    return quantize_cols(a)


@triton.jit
def _moe_down_rows_kernel(
    aq_ptr, as_ptr, gu_ptr, ids_ptr, n_live_ptr, proj_ptr, ps_ptr, w_ptr, out_ptr,
    R, H: tl.constexpr, I: tl.constexpr,
    stride_aqr, stride_asr, stride_gj, stride_gs, stride_ir, stride_ik,
    stride_pe, stride_pn, stride_pk, stride_se, stride_sn, stride_sk,
    stride_wr, stride_wk, stride_or,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SILU: tl.constexpr, KS: tl.constexpr, OUT_BF16: tl.constexpr, HOIST: tl.constexpr,
    EARLY: tl.constexpr, IDS_AHEAD: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
    PDL: tl.constexpr, SCALES_AHEAD: tl.constexpr,
):
    """Launches 4 and 5 as one, row-major (MoeLaunch.down_rows): program (r, t) walks row r's
    K experts in k order, each one's down tile t, and sums w[r, k] · y_k in registers — the
    combine without y in memory and without counters. Each slot's operand sits in column r of
    the MMA's narrow side (where `_moe_down_kernel` puts row r), the other columns 0, so y_k is
    that kernel's y bit for bit and the sum is `_combine_row`'s. An expert routed to several
    rows is streamed by each of their programs (from L2 after the first: no dedup). SILU: the
    operand from the gate/up partials (`_silu_cols`), else aq, sa. EARLY (with HOIST): the row's
    ids, router weights and operand scales are loaded before n_live is known (see
    `_down_rows_hoisted`). IDS_AHEAD (MoeLaunch.down_ids_ahead): the row's K expert ids are
    loaded before the loop and picked by one-hot sums (exact), so no tile address in the loop
    waits for a load made in it and the pipeliner can keep the next expert's tiles in flight
    during this one's MMAs (with ≥ 3 stages; the scales stay synchronous loads).
    SCALES_AHEAD (MoeLaunch.down_scales_ahead, with IDS_AHEAD, I ≤ 256): expert k + 1's weight
    and operand scales and router weight are loaded during expert k and carried into the next
    iteration (`_down_scales`): the pinned loop waits for three loads of its own in series
    (block 0's scales, block 1's, the router weight: sm_90 SASS), this one for loads all issued
    at its top; nothing is picked out of a K-wide register tile (`_down_rows_hoisted`). The
    same loads of the same values into the same operations: the same bits.
    TRACE (`moe_fp8(trace=…)`, hoisted or not): per program (r, t) at pid r·T + t, slot 0 its
    start (and its SM), 1 past the live-row exit, 2 + k after expert k's term is summed (slot 9:
    the last expert's when K > 8), 10 after its store (kernels/timeline.py)."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    pid = r * tl.num_programs(1) + tl.program_id(1)
    stamp_start(trace_ptr, pid, TRACE)
    n_live = tl.minimum(tl.load(n_live_ptr), R)
    if not (HOIST and EARLY):  # hoisted and early: the exit (and slot 1) after the early loads
        if r >= n_live:
            return
        stamp(trace_ptr, pid, 1, TRACE)
    h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden channels
    hm = h < H
    col = tl.arange(0, BLOCK_R)
    mine = col == r  # [BR] the operand's column
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if IDS_AHEAD:
        ks = tl.arange(0, triton.next_power_of_2(K))
        ids = tl.load(ids_ptr + r * stride_ir + ks * stride_ik, mask=ks < K, other=0)  # [K_PAD]
    if HOIST:
        _down_rows_hoisted(r, n_live, h, hm, mine, aq_ptr, as_ptr, ids_ptr, proj_ptr, ps_ptr,
                           w_ptr, out_ptr, stride_aqr, stride_asr, stride_ir, stride_ik,
                           stride_pe, stride_pn, stride_pk, stride_se, stride_sn, stride_sk,
                           stride_wr, stride_wk, stride_or, I, K, OUT_BF16, EARLY,
                           trace_ptr, pid, TRACE)
        return
    if SCALES_AHEAD:  # expert 0's, before the loop: [BN], [BR], [BN], [BR], scalar
        sw0_n, sa0_n, sw1_n, sa1_n, wt_n = _down_scales(
            ps_ptr, as_ptr, w_ptr, tl.sum(tl.where(ks == 0, ids, 0), axis=0), 0, r, h, hm,
            mine, stride_se, stride_sn, stride_sk, stride_asr, stride_wr, stride_wk, K, I)
    # pinned order: k = 0, 1, …, K−1 (the combine's). Pipelined over k only with IDS_AHEAD and
    # ≥ 3 stages: with the id loaded here Triton single-buffers the tiles and waits for all of
    # them at the top of each iteration (tests/kernels/test_moe.py sm_90 facts, in_flight)
    for kk in range(K):
        s = r * K + kk
        if IDS_AHEAD:
            e = tl.sum(tl.where(ks == kk, ids, 0), axis=0)
        else:
            e = tl.load(ids_ptr + r * stride_ir + kk * stride_ik)
        w_e = proj_ptr + e.to(tl.int64) * stride_pe
        s_e = ps_ptr + e.to(tl.int64) * stride_se
        src = tl.where(mine, s, -1)  # [BR]
        acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        if SCALES_AHEAD:
            sw0, sa0, sw1, sa1, wt = sw0_n, sa0_n, sw1_n, sa1_n, wt_n
            nxt = tl.minimum(kk + 1, K - 1)  # the last iteration loads its own again, unused
            sw0_n, sa0_n, sw1_n, sa1_n, wt_n = _down_scales(
                ps_ptr, as_ptr, w_ptr, tl.sum(tl.where(ks == nxt, ids, 0), axis=0), nxt, r,
                h, hm, mine, stride_se, stride_sn, stride_sk, stride_asr, stride_wr, stride_wk,
                K, I)
            acc = _down_block_given(acc, 0, aq_ptr, src, mine, w_e, h, hm, sw0, sa0,
                                    stride_aqr, stride_pn, stride_pk, I)
            if I > 128:
                acc = _down_block_given(acc, 128, aq_ptr, src, mine, w_e, h, hm, sw1, sa1,
                                        stride_aqr, stride_pn, stride_pk, I)
        else:
            for i0 in tl.static_range(0, I, 128):
                acc = _down_block(acc, i0, aq_ptr, as_ptr, gu_ptr, src, mine, w_e, s_e, h, hm,
                                  stride_aqr, stride_asr, stride_gj, stride_gs, stride_pn,
                                  stride_pk, stride_sn, stride_sk, I, KS, SILU)
        y = tl.sum(tl.where(mine[None, :], acc, 0.0), axis=1)  # [BN] column r: exact
        if SCALES_AHEAD:
            out = out + wt * y
        else:
            out = out + tl.load(w_ptr + r * stride_wr + kk * stride_wk) * y
        stamp_at(trace_ptr, pid, tl.minimum(2 + kk, 9), TRACE)
    if OUT_BF16:
        tl.store(out_ptr + r * stride_or + h, bf16_rne(out), mask=hm)
    else:
        tl.store(out_ptr + r * stride_or + h, out, mask=hm)
    stamp(trace_ptr, pid, 10, TRACE)


@triton.jit
def _down_scales(ps_ptr, as_ptr, w_ptr, e, kk, r, h, hm, mine, stride_se, stride_sn, stride_sk,
                 stride_asr, stride_wr, stride_wk, K: tl.constexpr, I: tl.constexpr):
    """Expert kk of row r (id e): the loads `_down_block` makes for K blocks 0 and 1 (the weight
    scales sw [BN], the operand scales sa [BR], column r only) and the router weight, at the
    same addresses under the same masks → (sw0, sa0, sw1, sa1, w). I ≤ 128: block 1's are
    block 0's again, unused."""
    s_e = ps_ptr + e.to(tl.int64) * stride_se
    src = tl.where(mine, r * K + kk, -1)  # [BR]
    sw0 = tl.load(s_e + (h // 128) * stride_sn, mask=hm, other=0.0)
    sa0 = tl.load(as_ptr + src * stride_asr, mask=mine, other=0.0)
    if I > 128:
        sw1 = tl.load(s_e + (h // 128) * stride_sn + stride_sk, mask=hm, other=0.0)
        sa1 = tl.load(as_ptr + src * stride_asr + 1, mask=mine, other=0.0)
    else:
        sw1, sa1 = sw0, sa0
    return sw0, sa0, sw1, sa1, tl.load(w_ptr + r * stride_wr + kk * stride_wk)


@triton.jit
def _down_block_given(acc, i0, aq_ptr, src, mine, w_e, h, hm, sw, sa, stride_aqr, stride_pn,
                      stride_pk, I: tl.constexpr):
    """`_down_block` on aq with its block's scales sw [BN], sa [BR] given (loaded ahead)."""
    ii = i0 + tl.arange(0, 128)
    im = ii < I
    aq = _down_operand(aq_ptr, src, mine, ii, im, stride_aqr)
    w = _down_weight(w_e, h, hm, ii, im, stride_pn, stride_pk)
    return acc + tl.dot(w.to(tl.float16), aq.to(tl.float16)) * (sw[:, None] * sa[None, :])


@triton.jit
def _down_rows_hoisted(r, n_live, h, hm, mine, aq_ptr, as_ptr, ids_ptr, proj_ptr, ps_ptr,
                       w_ptr, out_ptr, stride_aqr, stride_asr, stride_ir, stride_ik, stride_pe,
                       stride_pn, stride_pk, stride_se, stride_sn, stride_sk, stride_wr,
                       stride_wk, stride_or, I: tl.constexpr, K: tl.constexpr,
                       OUT_BF16: tl.constexpr, EARLY: tl.constexpr, trace_ptr, pid,
                       TRACE: tl.constexpr):
    """`_moe_down_rows_kernel`'s loop on aq, sa (MoeLaunch.down_hoist) with the row's K expert
    ids, router weights and every scale loaded before it. Triton's pipeliner carries only the
    loads that feed tl.dot (weight and operand tiles, through cp.async); a scale, weight or id
    load inside the loop is a synchronous round trip after each wait (the unhoisted loop's
    sm_90 code: ld.global of sw, sa, w and the next id between cp.async.wait_group and the
    MMAs). The same operations on the same values in the same order as `_down_block` and the
    loop there: the same bits.
    EARLY (MoeLaunch.early_loads): row r may be a padding row (r ≥ n_live); its ids, router
    weights and operand scales are in the buffers (valid memory) and are loaded before n_live
    arrives, but nothing addressed by an id is loaded and nothing is stored for it. The three
    loads are volatile: the compiler would otherwise sink them below the exit they do not feed
    (sm_90 code: loaded after n_live's round trip again).
    TRACE: the kernel's stamps (slot 1 here when EARLY: past this exit)."""
    K_PAD: tl.constexpr = triton.next_power_of_2(K)
    NB: tl.constexpr = triton.next_power_of_2((I + 127) // 128)  # down's K blocks, padded
    BN: tl.constexpr = h.shape[0]
    ks = tl.arange(0, K_PAD)
    kin = ks < K
    bs = tl.arange(0, NB)
    out = tl.zeros((BN,), dtype=tl.float32)
    ids = tl.load(ids_ptr + r * stride_ir + ks * stride_ik, mask=kin, other=0,
                  volatile=EARLY)  # [K_PAD]
    wts = tl.load(w_ptr + r * stride_wr + ks * stride_wk, mask=kin, other=0.0,
                  volatile=EARLY)  # [K_PAD]
    bm = kin[:, None] & (bs * 128 < I)[None, :]  # [K_PAD, NB]
    sa_all = tl.load(as_ptr + (r * K + ks)[:, None] * stride_asr + bs[None, :], mask=bm,
                     other=0.0, volatile=EARLY)  # [K_PAD, NB] slot r·K + k's scale per block
    if EARLY:  # the kernel exits padding rows before this point otherwise
        if r >= n_live:  # the ids above are not a live row's: no address from them
            return
        stamp(trace_ptr, pid, 1, TRACE)
    sw_all = tl.load(ps_ptr + ids.to(tl.int64)[:, None, None] * stride_se
                     + (h // 128)[None, None, :] * stride_sn + bs[None, :, None] * stride_sk,
                     mask=bm[:, :, None] & hm[None, None, :], other=0.0)  # [K_PAD, NB, BN]
    for kk in range(K):  # pinned order: k = 0, 1, …, K−1 (the combine's); pipelined over k
        sel = ks == kk
        e = tl.sum(tl.where(sel, ids, 0), axis=0)  # one-hot sums: exact
        sw_k = tl.sum(tl.where(sel[:, None, None], sw_all, 0.0), axis=0)  # [NB, BN]
        sa_k = tl.sum(tl.where(sel[:, None], sa_all, 0.0), axis=0)  # [NB]
        w_e = proj_ptr + e.to(tl.int64) * stride_pe
        src = tl.where(mine, r * K + kk, 0)  # [BR]
        acc = tl.zeros((BN, mine.shape[0]), dtype=tl.float32)
        for b in tl.static_range(0, NB):
            if b * 128 < I:
                ii = b * 128 + tl.arange(0, 128)
                im = ii < I
                aq = _down_operand(aq_ptr, src, mine, ii, im, stride_aqr)  # [128, BR] E4M3
                w = _down_weight(w_e, h, hm, ii, im, stride_pn, stride_pk)  # [BN, 128] E4M3
                sw = tl.sum(tl.where((bs == b)[:, None], sw_k, 0.0), axis=0)  # [BN]
                sa = tl.where(mine, tl.sum(tl.where(bs == b, sa_k, 0.0), axis=0), 0.0)  # [BR]
                acc = acc + tl.dot(w.to(tl.float16), aq.to(tl.float16)) * (sw[:, None]
                                                                            * sa[None, :])
        y = tl.sum(tl.where(mine[None, :], acc, 0.0), axis=1)  # [BN] column r: exact
        out = out + tl.sum(tl.where(sel, wts, 0.0), axis=0) * y
        stamp_at(trace_ptr, pid, tl.minimum(2 + kk, 9), TRACE)
    if OUT_BF16:
        tl.store(out_ptr + r * stride_or + h, bf16_rne(out), mask=hm)
    else:
        tl.store(out_ptr + r * stride_or + h, out, mask=hm)
    stamp(trace_ptr, pid, 10, TRACE)


@triton.jit
def _combine_row(y_ptr, w_ptr, out_ptr, r, h, hm, stride_yr, stride_wr, stride_wk, stride_or,
                 K: tl.constexpr, OUT_BF16: tl.constexpr, VOLATILE: tl.constexpr):
    """out[r, h] = Σ_k w[r, k] · y[r·K + k, h], FP32 in k order, one rounding. VOLATILE: y was
    written by other programs of this launch."""
    acc = tl.zeros(h.shape, dtype=tl.float32)
    for kk in tl.static_range(K):  # pinned order: k = 0, 1, …, K−1
        w = tl.load(w_ptr + r * stride_wr + kk * stride_wk)
        acc = acc + w * tl.load(y_ptr + (r * K + kk) * stride_yr + h, mask=hm, other=0.0,
                                volatile=VOLATILE)
    if OUT_BF16:
        tl.store(out_ptr + r * stride_or + h, bf16_rne(acc), mask=hm)
    else:
        tl.store(out_ptr + r * stride_or + h, acc, mask=hm)


@triton.jit
def _fold_combine(y_ptr, w_ptr, out_ptr, cnt_ptr, ids_ptr, e, n_live, h, hm, stride_yr,
                  stride_wr, stride_wk, stride_or, stride_ir, stride_ik,
                  K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                  OUT_BF16: tl.constexpr):
    """Launch 5 folded into launch 4: for each live row r routed to e, this program (hidden
    tile t) arrives on cnt[r, t] after storing its y; the K-th arrival — the row's K experts
    all wrote tile t — sums the row's tile in k order and puts cnt[r, t] back to 0 (the
    invariant between launches: all counters 0)."""
    t = tl.program_id(1)
    tiles = tl.num_programs(1)
    # release: every thread's y is stored before a counter moves
    tl.debug_barrier()
    ks = tl.arange(0, K_PAD)
    for r in range(0, BLOCK_R):  # rows ≥ n_live find no slot
        rid = tl.load(ids_ptr + r * stride_ir + ks * stride_ik, mask=(ks < K) & (r < n_live),
                      other=-1)
        if tl.max((rid == e).to(tl.int32), axis=0) > 0:
            done = tl.atomic_add(cnt_ptr + r * tiles + t, 1, sem="acq_rel", scope="gpu")
            if done == K - 1:
                _combine_row(y_ptr, w_ptr, out_ptr, r, h, hm, stride_yr, stride_wr, stride_wk,
                             stride_or, K, OUT_BF16, True)
                tl.store(cnt_ptr + r * tiles + t, 0)


@triton.jit
def _moe_combine_kernel(
    y_ptr, w_ptr, n_live_ptr, out_ptr, H,
    stride_yr, stride_wr, stride_wk, stride_or,
    K: tl.constexpr, BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr, PDL: tl.constexpr,
):
    """Launch 5 unfolded: grid (R, ⌈H/BH⌉), row r's tile through `_combine_row`."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    if r >= tl.load(n_live_ptr):
        return
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _combine_row(y_ptr, w_ptr, out_ptr, r, h, h < H, stride_yr, stride_wr, stride_wk, stride_or,
                 K, OUT_BF16, False)


# --- wrappers ----------------------------------------------------------------------------------


def _check_routing(x_rows: int, ids: torch.Tensor, device, weights=None) -> int:
    check_tensor("ids", ids, dims=2, dtypes=(torch.int32, torch.int64), device=device)
    if ids.shape[0] != x_rows:
        raise ValueError(f"ids: expected {x_rows} rows (the row buffer), got {tuple(ids.shape)}")
    k = ids.shape[1]
    if not 1 <= k <= 16:
        raise ValueError(f"ids: top-k must be in [1, 16], got {k}")
    if weights is not None:
        check_tensor("weights", weights, shape=(x_rows, k), dtypes=(torch.float32,), device=device)
    return k


def _check_experts(name: str, w, s, rows_out: int | None, cols: int | None, device):
    check_tensor(name, w, dims=3, dtypes=(E4M3,), device=device)
    e, n, c = w.shape
    if rows_out is not None and n != rows_out:
        raise ValueError(f"{name}: expected dim 1 = {rows_out}, got shape {tuple(w.shape)}")
    if cols is not None and c != cols:
        raise ValueError(f"{name}: expected dim 2 = {cols}, got shape {tuple(w.shape)}")
    check_tensor(f"{name}_scale_inv", s, shape=(e, blocks(n), blocks(c)),
                 dtypes=(torch.float32,), device=device)


def _check_rows(r: int) -> None:
    if not 1 <= r <= BLOCK_R:
        raise ValueError(f"row buffer: expected 1..{BLOCK_R} rows, got {r}")


@dataclass(frozen=True)
class _GateUp:
    """A validated gate/up call: operand, routing and launch, shared by the stage-1 API and
    moe_fp8."""

    xq: torch.Tensor  # [R, H] E4M3
    xs: torch.Tensor  # [R, ⌈H/128⌉] fp32
    ids: torch.Tensor  # [R, K]
    fc: torch.Tensor
    fc_scale_inv: torch.Tensor
    n: torch.Tensor  # [1] int32 live rows
    rows: int
    hidden: int
    inter: int
    k: int
    cfg: MoeLaunch
    pdl: bool
    trace: torch.Tensor | None = None  # [S·T·KS, SLOTS] int64: launch 2's stamps


def _gate_up_call(x, ids, fc, fc_scale_inv, n_live, config, quantized, pdl,
                  trace=None) -> _GateUp:
    check_tensor("x", x, dims=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    r, hidden = x.shape
    _check_rows(r)
    dev = x.device
    k = _check_routing(r, ids, dev)
    _check_experts("fc", fc, fc_scale_inv, None, hidden, dev)
    if fc.shape[1] % 2:
        raise ValueError(f"fc: dim 1 must be 2·I (gate rows then up rows), got {fc.shape[1]}")
    inter = fc.shape[1] // 2
    n = live_count(n_live, r, dev)
    cfg = config or moe_launch(hidden, inter, dev.type)
    if trace is not None:
        check_trace(trace, r * k * triton.cdiv(inter, cfg.gate_up_block_n)
                    * cfg.k_splits(hidden), dev)
    if quantized is None:
        xq, xs = quantize_act(x, n, pdl=pdl)
    else:
        xq, xs = check_quantized("quantized", quantized, r, hidden, dev)
    return _GateUp(xq, xs, ids, fc, fc_scale_inv, n, r, hidden, inter, k, cfg, pdl, trace)


@dataclass(frozen=True)
class MoeScratch:
    """The folded launches' arrival counters (`_fold_silu`: one per slot; `_fold_combine`: one
    per row and hidden tile), all 0 between launches — the last program to arrive puts its
    counter back. Made once per device and reused by every call (a captured graph replays it);
    a fresh one costs a fill launch."""

    counters: torch.Tensor  # [MAX_SLOTS + BLOCK_R·MAX_TILES] int32

    @classmethod
    def create(cls, device) -> MoeScratch:
        return cls(torch.zeros(COUNTERS, dtype=torch.int32, device=device))

    def reset(self) -> None:
        """After an aborted launch (device synchronized): every counter 0."""
        self.counters.zero_()


def _scratch(scratch: MoeScratch | None, fold: bool, device) -> MoeScratch | None:
    """The counters a folded launch uses (checked whenever given), None when not folded."""
    if scratch is not None:
        check_tensor("scratch.counters", scratch.counters, shape=(COUNTERS,),
                     dtypes=(torch.int32,), device=device)
    if not fold:
        return None
    return MoeScratch.create(device) if scratch is None else scratch


def _gate_up_grid(cfg: MoeLaunch, slots: int, tiles: int, ks: int) -> tuple[int, ...]:
    """Launch 2's grid: (slot, tile, split), or its size in one dimension (cfg.gate_up_compact:
    program w, work item w)."""
    return (slots * tiles * ks,) if cfg.gate_up_compact else (slots, tiles, ks)


def _gate_up_silu(g: _GateUp, *, a=None, aq=None, sa=None,
                  scratch: MoeScratch | None = None, silu: bool = True,
                  prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """Launch 2, then 3 (or 3 inside 2, cfg.fold_silu): the K-split partials, then SiLU(gate)·up
    per live slot into a (FP32) or, quantized, into (aq, sa). silu False: launch 2 only (the
    down launch computes SiLU·up itself, cfg.silu_in_down). prefetch: launch 4's proj [E, H, I]
    (contiguous per expert), whose first experts launch 3 asks L2 for (cfg.silu_prefetch).
    → the partials [KS, S, 2I]."""
    cfg, r, k, inter = g.cfg, g.rows, g.k, g.inter
    ks = cfg.k_splits(g.hidden)
    part = torch.empty(ks, r * k, 2 * inter, dtype=torch.float32, device=g.xq.device)
    quant = a is None
    dummy = part
    if not silu:
        a_, aq_, sa_, strides = dummy, dummy, dummy, (0, 0, 0)
    elif quant:
        a_, aq_, sa_, strides = dummy, aq, sa, (0, aq.stride(0), sa.stride(0))
    else:
        a_, aq_, sa_, strides = a, dummy, dummy, (a.stride(0), 0, 0)
    groups = triton.next_power_of_2(blocks(inter))
    sc = _scratch(scratch, cfg.fold_silu, g.xq.device)
    grid = _gate_up_grid(cfg, r * k, triton.cdiv(inter, cfg.gate_up_block_n), ks)
    _moe_gate_up_kernel[grid](
        g.xq, g.xs, g.ids, g.n, g.fc, g.fc_scale_inv, part,
        dummy if sc is None else sc.counters, a_, aq_, sa_, r, g.hidden, inter,
        g.xq.stride(0), g.xs.stride(0), g.ids.stride(0), g.ids.stride(1),
        *g.fc.stride(), *g.fc_scale_inv.stride(), part.stride(0), part.stride(1), *strides,
        K=k, K_PAD=triton.next_power_of_2(k), S_PAD=max(16, triton.next_power_of_2(r * k)),
        BLOCK_N=cfg.gate_up_block_n, BLOCK_R=BLOCK_R,
        K_BLOCKS=cfg.k_blocks(g.hidden), FOLD=sc is not None, KS=ks, GROUPS=groups,
        QUANT=quant, HOIST=cfg.gate_up_hoist, EARLY=cfg.early_loads,
        trace_ptr=part if g.trace is None else g.trace, TRACE=g.trace is not None,
        COMPACT=cfg.gate_up_compact,
        num_warps=cfg.gate_up_warps, num_stages=cfg.gate_up_stages,
        **launch_opts(g.pdl),
    )
    if sc is not None or not silu:
        return part
    pf = cfg.silu_prefetch if prefetch is not None else 0
    proj = prefetch if pf else part  # pointer unused without PREFETCH
    _moe_silu_kernel[(r * k,)](
        part, g.n, a_, aq_, sa_, g.ids, proj, r, part.stride(0), part.stride(1), *strides,
        g.ids.stride(0), g.ids.stride(1), proj.stride(0) if pf else 0,
        I=inter, K=k, KS=ks, GROUPS=groups, QUANT=quant, PREFETCH=min(pf, k),
        LINES=-(-proj[0].numel() // 128) if pf else 1,  # E4M3: one byte an element
        num_warps=cfg.num_warps, **launch_opts(g.pdl),
    )
    return part


@twin(_twins.moe_gate_up_fp8_ref)
def moe_gate_up_fp8(
    x: torch.Tensor,  # [R, H] bf16 / fp16 / fp32 (padding rows may hold anything)
    ids: torch.Tensor,  # [R, K] int32 / int64, distinct within a row, in [0, E)
    fc: torch.Tensor,  # [E, 2I, H] E4M3
    fc_scale_inv: torch.Tensor,  # [E, ⌈2I/128⌉, ⌈H/128⌉] fp32
    n_live: torch.Tensor | None = None,  # device int32 [1]; None = all R rows
    *,
    out: torch.Tensor | None = None,  # [R·K, I] fp32, unit column stride
    config: MoeLaunch | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,  # quantize_act(x) made earlier
    scratch: MoeScratch | None = None,  # the folded SiLU's counters; None: made for this call
    pdl: bool = False,
) -> torch.Tensor:
    """Stage 1: SiLU(gate)·up per slot, FP32 [R·K, I]; slots of rows ≥ n untouched. quantized =
    (xq [R, H] E4M3, xs [R, ⌈H/128⌉] fp32), unit column strides, equal to quantize_act(x) on the
    live rows (kernels/tails.py attn_tail made it): no quantization launch.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    g = _gate_up_call(x, ids, fc, fc_scale_inv, n_live, config, quantized, pdl)
    dev = x.device
    if out is None:
        out = torch.empty(g.rows * g.k, g.inter, dtype=torch.float32, device=dev)
    check_tensor("out", out, shape=(g.rows * g.k, g.inter), dtypes=(torch.float32,), device=dev)
    if out.stride(1) != 1:
        raise ValueError(f"out: expected unit column stride, got strides {out.stride()}")
    _gate_up_silu(g, a=out, scratch=scratch)
    return out


@dataclass(frozen=True)
class _Down:
    """A validated down + combine call."""

    weights: torch.Tensor  # [R, K] fp32
    ids: torch.Tensor
    proj: torch.Tensor
    proj_scale_inv: torch.Tensor
    n: torch.Tensor
    out: torch.Tensor  # [R, H] bf16 | fp32
    cfg: MoeLaunch
    pdl: bool
    trace: torch.Tensor | None = None  # [R·T, SLOTS] int64: the row-major down's stamps


def _down_call(weights, ids, proj, proj_scale_inv, n_live, inter, out, out_dtype, config,
               pdl, trace=None) -> _Down:
    dev = weights.device
    check_tensor("weights", weights, dims=2, dtypes=(torch.float32,), device=dev)
    r = weights.shape[0]
    _check_rows(r)
    _check_routing(r, ids, dev, weights)
    _check_experts("proj", proj, proj_scale_inv, None, inter, dev)
    hidden = proj.shape[1]
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    n = live_count(n_live, r, dev)
    if out is None:
        out = torch.empty(r, hidden, dtype=out_dtype, device=dev)
    check_tensor("out", out, shape=(r, hidden), dtypes=(out_dtype,), device=dev)
    if out.stride(1) != 1:
        raise ValueError(f"out: expected unit column stride, got strides {out.stride()}")
    cfg = config or moe_launch(hidden, inter, dev.type)
    tiles = triton.cdiv(hidden, cfg.down_block_n)
    if cfg.down_scales_ahead and inter > 256:
        raise ValueError(f"MoeLaunch.down_scales_ahead: carries two K blocks' scales, so the "
                         f"intermediate size must be <= 256; proj has I = {inter}")
    if cfg.fold_combine and tiles > MAX_TILES:
        raise ValueError(f"MoeLaunch.down_block_n: {cfg.down_block_n} gives {tiles} hidden "
                         f"tiles at H {hidden}; the folded combine counts at most {MAX_TILES}")
    if trace is not None:
        if not cfg.down_rows:
            raise ValueError("trace: stamps the row-major down's expert loop (MoeLaunch."
                             "down_rows on)")
        check_trace(trace, r * tiles, dev)
    return _Down(weights, ids, proj, proj_scale_inv, n, out, cfg, pdl, trace)


def _down_combine(d: _Down, aq: torch.Tensor | None, sa: torch.Tensor | None,
                  scratch: MoeScratch | None = None,
                  part: torch.Tensor | None = None) -> torch.Tensor:
    """Launches 4 and 5 (or 5 inside 4, cfg.fold_combine) on the quantized intermediate
    aq [S, I] E4M3, sa [S, ⌈I/128⌉] — or, given the gate/up partials part [KS, S, 2I]
    (cfg.silu_in_down), on those: aq and sa are then None."""
    r, k = d.weights.shape
    hidden, inter = d.proj.shape[1], d.proj.shape[2]
    cfg, out = d.cfg, d.out
    if cfg.down_rows:
        _down_rows(d, aq, sa, part)
        return out
    y = torch.empty(r * k, hidden, dtype=torch.float32, device=out.device)  # [S, H] per slot
    tiles = triton.cdiv(hidden, cfg.down_block_n)
    fold = cfg.fold_combine
    sc = _scratch(scratch, fold, out.device)
    bf16 = out.dtype == torch.bfloat16
    silu = part is not None
    aq, sa = (y, y) if silu else (aq, sa)  # unread pointers when silu
    gu = part if silu else y
    _moe_down_kernel[(r * k, tiles)](
        aq, sa, d.ids, d.n, d.proj, d.proj_scale_inv, y, d.weights, out,
        y if sc is None else sc.counters[MAX_SLOTS:], gu, r, hidden, inter,
        aq.stride(0), sa.stride(0), d.ids.stride(0), d.ids.stride(1),
        *d.proj.stride(), *d.proj_scale_inv.stride(), y.stride(0),
        d.weights.stride(0), d.weights.stride(1), out.stride(0),
        gu.stride(0) if silu else 0, gu.stride(1) if silu else 0,
        K=k, K_PAD=triton.next_power_of_2(k), S_PAD=max(16, triton.next_power_of_2(r * k)),
        BLOCK_N=cfg.down_block_n, BLOCK_R=BLOCK_R, FOLD=fold, SILU=silu,
        KS=part.shape[0] if silu else 1, OUT_BF16=bf16, EARLY=cfg.early_loads,
        num_warps=cfg.down_warps, num_stages=cfg.down_stages, **launch_opts(d.pdl),
    )
    if fold:
        return out
    _moe_combine_kernel[(r, triton.cdiv(hidden, cfg.combine_block_h))](
        y, d.weights, d.n, out, hidden, y.stride(0), d.weights.stride(0), d.weights.stride(1),
        out.stride(0), K=k, BLOCK_H=cfg.combine_block_h, OUT_BF16=bf16,
        num_warps=cfg.num_warps, **launch_opts(d.pdl),
    )
    return out


def _down_rows(d: _Down, aq, sa, part) -> None:
    """Launches 4 + 5 as `_moe_down_rows_kernel`, grid (R, ⌈H/BN⌉)."""
    r, k = d.weights.shape
    hidden, inter = d.proj.shape[1], d.proj.shape[2]
    cfg, out = d.cfg, d.out
    silu = part is not None
    aq, sa = (part, part) if silu else (aq, sa)  # unread pointers when silu
    gu = part if silu else aq
    _moe_down_rows_kernel[(r, triton.cdiv(hidden, cfg.down_block_n))](
        aq, sa, gu, d.ids, d.n, d.proj, d.proj_scale_inv, d.weights, out, r, hidden, inter,
        0 if silu else aq.stride(0), 0 if silu else sa.stride(0),
        gu.stride(0) if silu else 0, gu.stride(1) if silu else 0,
        d.ids.stride(0), d.ids.stride(1), *d.proj.stride(), *d.proj_scale_inv.stride(),
        d.weights.stride(0), d.weights.stride(1), out.stride(0),
        K=k, BLOCK_N=cfg.down_block_n, BLOCK_R=BLOCK_R, SILU=silu,
        KS=part.shape[0] if silu else 1, OUT_BF16=out.dtype == torch.bfloat16,
        HOIST=cfg.down_hoist, EARLY=cfg.early_loads,
        # hoisted: its ids are ahead; scales ahead: they need the ids ahead
        IDS_AHEAD=(cfg.down_ids_ahead or cfg.down_scales_ahead) and not cfg.down_hoist,
        SCALES_AHEAD=cfg.down_scales_ahead,
        trace_ptr=out if d.trace is None else d.trace, TRACE=d.trace is not None,
        num_warps=cfg.down_warps, num_stages=cfg.down_stages, **launch_opts(d.pdl),
    )


@twin(_twins.moe_down_fp8_ref)
def moe_down_fp8(
    a: torch.Tensor,  # [R·K, I] fp32 from moe_gate_up_fp8
    weights: torch.Tensor,  # [R, K] fp32 router weights
    ids: torch.Tensor,  # [R, K]
    proj: torch.Tensor,  # [E, H, I] E4M3
    proj_scale_inv: torch.Tensor,  # [E, ⌈H/128⌉, ⌈I/128⌉] fp32
    n_live: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,  # [R, H] out_dtype, unit column stride
    out_dtype: torch.dtype = torch.bfloat16,
    config: MoeLaunch | None = None,
    scratch: MoeScratch | None = None,  # the folded combine's counters; None: made for this call
    pdl: bool = False,
) -> torch.Tensor:
    """Stage 2: requantize a per slot per 128 columns, down GEMM, k-ordered weighted sum → [R, H]
    (bf16 by default, or fp32); rows ≥ n untouched.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    check_tensor("a", a, dims=2, dtypes=(torch.float32,), device=weights.device)
    d = _down_call(weights, ids, proj, proj_scale_inv, n_live, a.shape[1], out, out_dtype,
                   config, pdl)
    r, k = weights.shape
    if a.shape[0] != r * k:
        raise ValueError(f"a: expected {r * k} slot rows (R·K), got shape {tuple(a.shape)}")
    aq, sa = quantize_act(a, d.n, rows_per_live=k, pdl=pdl)
    return _down_combine(d, aq, sa, scratch)


@twin(_twins.moe_fp8_ref)
def moe_fp8(
    x: torch.Tensor,  # [R, H] expert input (normalized hidden), R ≤ 16
    weights: torch.Tensor,  # [R, K] fp32 router weights
    ids: torch.Tensor,  # [R, K] expert ids, distinct within a row, in [0, E)
    fc: torch.Tensor,  # [E, 2I, H] E4M3
    fc_scale_inv: torch.Tensor,  # [E, ⌈2I/128⌉, ⌈H/128⌉] fp32
    proj: torch.Tensor,  # [E, H, I] E4M3
    proj_scale_inv: torch.Tensor,  # [E, ⌈H/128⌉, ⌈I/128⌉] fp32
    n_live: torch.Tensor | None = None,  # device int32 [1]; None = all R rows
    *,
    out: torch.Tensor | None = None,  # [R, H] out_dtype
    out_dtype: torch.dtype = torch.bfloat16,
    config: MoeLaunch | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,  # see moe_gate_up_fp8
    scratch: MoeScratch | None = None,  # see moe_gate_up_fp8
    pdl: bool = False,
    trace: torch.Tensor | None = None,  # [R·⌈H/down_block_n⌉, SLOTS] int64 (kernels/timeline.py)
    gate_up_trace: torch.Tensor | None = None,  # [R·K·⌈I/gate_up_block_n⌉·KS, SLOTS] int64
) -> torch.Tensor:
    """Σ_k weights[r, k] · expert_{ids[r, k]}(x_r) for live rows r < n → [R, H] (bf16 default).

    Bit for bit moe_down_fp8(moe_gate_up_fp8(x, …), …): the SiLU launch quantizes the FP32
    intermediate it computed with quantize_act's operations instead of storing it.
    n_live is never read on the host, so the call is CUDA-graph capturable for a fixed R. Rows ≥ n
    of x, weights, ids are never used (with MoeLaunch.early_loads the ids, router weights and
    scales of padding rows are read, valid memory, and dropped) and of out never written. ids
    must be valid expert indices (checked by the router, not here: checking device values would
    need a host sync).
    pdl: programmatic dependent launch (kernels/launch.py).
    trace (CUDA only, the row-major down of MoeLaunch.down_rows, hoisted or not): per-program
    timestamps of the down launch (`_moe_down_rows_kernel`'s slots); gate_up_trace (CUDA only):
    those of the gate/up launch (`_moe_gate_up_kernel`'s slots)."""
    check_tensor("x", x, dims=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    if proj.dim() == 3 and proj.shape[1] != x.shape[1]:
        raise ValueError(f"proj: expected dim 1 = hidden {x.shape[1]}, got {tuple(proj.shape)}")
    g = _gate_up_call(x, ids, fc, fc_scale_inv, n_live, config, quantized, pdl, gate_up_trace)
    d = _down_call(weights, ids, proj, proj_scale_inv, g.n, g.inter, out, out_dtype, g.cfg, pdl,
                   trace)
    if scratch is None and (g.cfg.fold_silu or g.cfg.fold_combine):
        scratch = MoeScratch.create(x.device)
    if g.cfg.silu_in_down:
        part = _gate_up_silu(g, scratch=scratch, silu=False)
        return _down_combine(d, None, None, scratch, part=part)
    s = g.rows * g.k
    aq = torch.empty(s, g.inter, dtype=E4M3, device=x.device)
    sa = torch.empty(s, blocks(g.inter), dtype=torch.float32, device=x.device)
    if g.cfg.silu_prefetch and (x.device.type != "cuda" or not proj[0].is_contiguous()):
        raise ValueError(f"MoeLaunch.silu_prefetch: an L2 prefetch hint (PTX) of proj[e] as one "
                         f"contiguous range: compiled kernels on CUDA only, got proj "
                         f"{tuple(proj.shape)} strides {proj.stride()} on {x.device.type}")
    _gate_up_silu(g, aq=aq, sa=sa, scratch=scratch, prefetch=proj)
    return _down_combine(d, aq, sa, scratch)
