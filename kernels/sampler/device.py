"""The @triton.jit code of the sampler (kernels/sampler/): the shared device helpers
(kernels/verify.py uses them too) and the scan, merge and exp kernels with their compile options.
Dimension letters as in kernels/sampler/.

Order keys. A candidate is one int64, key = (m(z) << 32) | (2^31 − 1 − id) with m the monotone
map of fp32 bits onto int32 (−0.0 first made +0.0, as torch.sort compares). Keys are distinct
and `key_a > key_b` is exactly the reference's total order (z desc, id asc), so every top-k
step is one integer max. EMPTY is below every real key (also below −inf logits).

Launches (all programs of a row are independent; rows ≥ n_live are neither read nor written):
  1. scan, grid (R, N, T): a tile of TILE logits → z = x / T (IEEE division) → its own top-K
     keys by K rounds of max-and-remove, into cand [R, N, T, KP]. Slot 0 is the tile maximum.
  2. (N > 1 only) local merge, grid (R, N): each shard's T·K candidates → its top-K keys,
     [R, N, KP]. A real TP rank stops here (`topk_candidates`) and all-gathers these keys.
  3. final merge, grid (R,): the G·K candidates of a row → the global top-K → softmax, top-p,
     renormalization, final order and the draw, exactly as reference/sampling.py pins them.
Tile maxima skip work in the merges: when G ≥ K, the K-th largest group maximum τ is a lower
bound of the row's K-th key (those K maxima are K distinct keys of the row), so a group whose
maximum is below τ cannot hold a winner. Exactly K groups reach τ; the merge gathers those
(all G when G < K: no bound) into [min(GP, KP), KP] keys, so its selection rounds cost the same
for 3 tiles or 600, and drops loaded keys below τ.

Exactness. All sums are sequential fp32 loops in the reference's order; divisions use div_rn;
the kernels launch with FMA contraction and libdevice flush-to-zero off. exp is the one
primitive not pinned: libdevice `__nv_expf` on the GPU, NumPy's float32 exp under the
interpreter (up to 3 ulp from the reference's FP64-rounded exp32). kernels/sampler/ `kernel_exp`
exposes this exact exp so a test can replay the semantics bit for bit; against the exp32 twin the
probabilities follow the tolerance row kernels.sampler.probs.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.launch import pdl_enter

EMPTY = tl.constexpr(-(2**63) + 1)  # below every real key
U24 = tl.constexpr(5.9604644775390625e-08)  # 2^-24
_COMPILE = dict(enable_fp_fusion=False, enable_reflect_ftz=False)  # ignored by the interpreter


# --- shared @triton.jit helpers (kernels/verify.py uses them too) ---------------------------


@triton.jit
def order_key(z, idx):
    z = tl.where(z == 0.0, 0.0, z)
    b = z.to(tl.int32, bitcast=True)
    m = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return (m.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64)


@triton.jit
def key_value(key):
    m = (key >> 32).to(tl.int32)
    return tl.where(m < 0, m ^ 0x7FFFFFFF, m).to(tl.float32, bitcast=True)


@triton.jit
def key_index(key):
    return 2147483647 - (key & 2147483647).to(tl.int32)


@triton.jit
def exp_f32(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def uniform(seed, position, purpose, index):
    """reference.rng.uniforms for one counter (position, purpose, index, 0)."""
    p = position.to(tl.uint32)
    zero = p * 0
    c1 = (zero + purpose).to(tl.uint32)  # purpose / index may arrive as constexpr
    c2 = (zero + index).to(tl.uint32)
    x, _, _, _ = tl.philox(seed, p, c1, c2, zero)
    return (x >> 8).to(tl.float32) * U24


@triton.jit
def rank_desc(v, ids, valid):
    """Position of each valid entry in the order (v desc, ids asc); invalid entries get 2^20."""
    vj, vi = v[None, :], v[:, None]
    before = (vj > vi) | ((vj == vi) & (ids[None, :] < ids[:, None]))
    r = tl.sum((before & valid[None, :]).to(tl.int32), axis=1)
    return tl.where(valid, r, 1 << 20)


@triton.jit
def seq_sum(ptr, n, N: tl.constexpr):
    """Sequential fp32 sum of ptr[0..n-1], n ≤ N (stored before a barrier)."""
    s = tl.full([], 0.0, tl.float32)
    for r in range(N):
        s += tl.load(ptr + r, mask=r < n, other=0.0)
    return s


@triton.jit
def draw_stored(vals_ptr, ids_ptr, n, N: tl.constexpr, u):
    """reference.sampling.draw on one row stored in draw order (prob desc, id asc), n ≤ N
    entries, support first: the first i with fl(u·Z) < c_i, else the last support entry."""
    t = u * seq_sum(vals_ptr, n, N)
    c = tl.full([], 0.0, tl.float32)
    pick = tl.full([], -1, tl.int32)
    last = tl.full([], 0, tl.int32)
    for r in range(N):
        v = tl.load(vals_ptr + r, mask=r < n, other=0.0)
        c += v
        pick = tl.where((pick < 0) & (v > 0.0) & (t < c), r, pick)
        last = tl.where(v > 0.0, r, last)
    return tl.load(ids_ptr + tl.where(pick < 0, last, pick))


@triton.jit
def top_keys(keys, K: tl.constexpr, KP: tl.constexpr, BITONIC: tl.constexpr):
    """The K largest keys of `keys` (distinct, or EMPTY) in descending order, then EMPTY: [KP].
    Either K rounds of max-and-remove, or a bitonic top-KP (tl.topk); the keys are distinct, so
    both give the same bits and the choice is a launch-configuration one."""
    slot = tl.arange(0, KP)
    if BITONIC:
        top = tl.where(slot < K, tl.topk(keys, KP), EMPTY)
    else:
        top = tl.full([KP], EMPTY, tl.int64)
        for i in range(K):
            best = tl.max(keys, axis=0)
            top = tl.where(slot == i, best, top)
            keys = tl.where(keys == best, EMPTY, keys)
    return top


# --- kernels ---------------------------------------------------------------------------------


@triton.jit
def _scan_kernel(
    x_ptr, cand_ptr, n_live_ptr, temperature, vals_ptr, id_offset,
    shard_base, shard_rem, stride_xr, stride_cr, stride_cs, stride_ct,
    K: tl.constexpr, KP: tl.constexpr, TILE: tl.constexpr, GREEDY: tl.constexpr,
    BITONIC: tl.constexpr, VALS_FROM_PTR: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    if row >= tl.load(n_live_ptr):
        return
    s = tl.program_id(1)
    t = tl.program_id(2)
    # shard s covers [s·base + min(s, rem), … + base + (s < rem)), the torch.tensor_split rule
    start = s * shard_base + tl.minimum(s, shard_rem)
    size = shard_base + (s < shard_rem).to(tl.int32)
    offs = t * TILE + tl.arange(0, TILE)  # [TILE]
    live = offs < size
    col = start + offs
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xr + col, mask=live, other=0.0)
    idx = id_offset + col
    if GREEDY:
        z = x
    else:
        if VALS_FROM_PTR:  # kernels/sampler/values.py: [temperature, top_p, apply_top_p]
            temperature = tl.load(vals_ptr)
        z = tl.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * temperature)
    keys = tl.where(live, order_key(z, idx), EMPTY)  # [TILE]
    slot = tl.arange(0, KP)
    top = top_keys(keys, K, KP, BITONIC)
    tl.store(cand_ptr + row * stride_cr + s * stride_cs + t * stride_ct + slot, top)


@triton.jit
def _merge_kernel(
    cand_ptr, stride_cr, stride_cs, stride_cg, G,
    keys_ptr, stride_kr, stride_ks,
    tok_ptr, ids_ptr, probs_ptr, stride_ir, stride_pr,
    pos_ptr, seed, seed_ptr, n_live_ptr, top_p, apply_top_p, vals_ptr, purpose, index,
    K: tl.constexpr, KP: tl.constexpr, GP: tl.constexpr, SP: tl.constexpr,
    FINAL: tl.constexpr, GREEDY: tl.constexpr, SEED_FROM_PTR: tl.constexpr,
    LIBDEVICE: tl.constexpr, BITONIC: tl.constexpr, VALS_FROM_PTR: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    if row >= tl.load(n_live_ptr):
        return
    s = tl.program_id(1)
    base = cand_ptr + row * stride_cr + s * stride_cs  # groups [G, KP]
    gi = tl.arange(0, GP)
    gmax = tl.load(base + gi * stride_cg, mask=gi < G, other=EMPTY)  # [GP] slot 0 = group max
    slot = tl.arange(0, KP)
    if GP <= 64:  # rank of each maximum by one [GP, GP] comparison
        grank = tl.sum((gmax[None, :] > gmax[:, None]).to(tl.int32), axis=1)
        tau = tl.max(tl.where(grank == K - 1, gmax, EMPTY), axis=0)
    else:  # many small tiles: the K-th largest maximum by K rounds over [GP]
        tau = tl.max(tl.where(slot == K - 1, top_keys(gmax, K, KP, False), EMPTY), axis=0)
    tau = tl.where(G >= K, tau, EMPTY)
    # the min(G, K) groups whose maximum reaches τ, gathered in group order into [SP, KP]:
    # sel_j = the group with j selected groups before it (j < count)
    sel = (gi < G) & (gmax >= tau)
    before = tl.cumsum(sel.to(tl.int32), axis=0) - 1  # [GP]
    j = tl.arange(0, SP)
    gathered = sel[:, None] & (before[:, None] == j[None, :])  # [GP, SP]
    grp = tl.sum(tl.where(gathered, gi[:, None], 0), axis=0)  # [SP]
    jok = tl.sum(gathered.to(tl.int32), axis=0) > 0
    keys = tl.load(base + grp[:, None] * stride_cg + slot[None, :],
                   mask=jok[:, None] & (slot < K)[None, :], other=EMPTY)  # [SP, KP]
    keys = tl.reshape(keys, [SP * KP])
    keys = tl.where(keys >= tau, keys, EMPTY)
    top = top_keys(keys, K, KP, BITONIC)  # [KP] (z desc, id asc)
    if not FINAL:
        tl.store(keys_ptr + row * stride_kr + s * stride_ks + slot, top)
        return
    ids = key_index(top).to(tl.int64)
    valid = slot < K
    if GREEDY:
        tok = tl.sum(tl.where(slot == 0, ids, 0), axis=0)
        tl.store(ids_ptr + row * stride_ir + slot, ids, mask=slot == 0)
        tl.store(probs_ptr + row * stride_pr + slot, tl.where(slot == 0, 1.0, 0.0), mask=slot == 0)
        tl.store(tok_ptr + row, tok)
        return
    # The sequential sums run over the output row: store in the order, barrier, scalar loop.
    prow = probs_ptr + row * stride_pr
    irow = ids_ptr + row * stride_ir
    z = key_value(top)
    m = tl.max(tl.where(slot == 0, z, -float("inf")), axis=0)
    e = tl.where(valid, exp_f32(z - m, LIBDEVICE), 0.0)
    tl.store(prow + slot, e, mask=valid)  # (z desc, id asc) order
    tl.debug_barrier()
    ssum = seq_sum(prow, K, K)
    p = tl.where(valid, tl.div_rn(e, tl.full(e.shape, 1.0, tl.float32) * ssum), 0.0)
    rp = rank_desc(p, ids, valid)
    tl.debug_barrier()
    tl.store(prow + rp, p, mask=valid)  # (p desc, id asc) order
    tl.debug_barrier()
    if VALS_FROM_PTR:
        top_p = tl.load(vals_ptr + 1)
        apply_top_p = (tl.load(vals_ptr + 2) != 0.0).to(tl.int32)
    c = tl.full([], 0.0, tl.float32)
    first = tl.full([], K, tl.int32)
    s2 = c
    for r in range(K):
        c += tl.load(prow + r)
        hit = (first == K) & (c >= top_p)
        first = tl.where(hit, r, first)
        s2 = tl.where(hit, c, s2)
    cut = (apply_top_p != 0) & (first < K)
    s2 = tl.where(cut, s2, c)
    keep = valid & ((rp <= first) | ~cut)  # a cut keeps the token that crosses top_p
    served = tl.where(keep, tl.div_rn(p, tl.full(p.shape, 1.0, tl.float32) * s2), 0.0)
    rf = rank_desc(served, ids, valid)  # final order: (served desc, id asc)
    tl.debug_barrier()
    tl.store(prow + rf, served, mask=valid)
    tl.store(irow + rf, ids, mask=valid)
    tl.debug_barrier()
    if SEED_FROM_PTR:
        sd = tl.load(seed_ptr)
    else:
        sd = seed
    u = uniform(sd, tl.load(pos_ptr + row), purpose, index)
    tl.store(tok_ptr + row, draw_stored(prow, irow, K, K, u))


@triton.jit
def _exp_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
                PDL: tl.constexpr):
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, exp_f32(x, LIBDEVICE), mask=offs < n)
