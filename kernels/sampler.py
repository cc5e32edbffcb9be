"""Fused temperature / top-k / top-p sampler with the counter-based draw (kernel family 6).
Twin: reference/sampling_twins.py `sample_ref` (reference.sampling.served_candidates + draw +
reference.rng.uniforms); results equal it bit for bit except through exp (see below).

Dimension letters: R rows (≤ 8 in use), V vocabulary, N shards (virtual TP ranks), Vs = the
vocabulary of one shard, T tiles per shard, K = top_k (≤ 64), KP = next power of two ≥ K,
G candidate groups of one merge (tiles, or shards), W output width (K, or 1 when greedy).

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
maximum is below τ cannot hold a winner: its candidates are not loaded, and loaded keys below
τ are dropped. With fewer groups than K there is no such bound and every group is read.
Sharded and unsharded runs pick the same key set (a total order has one top-K and every
shard's top-K contains that shard's share of it), and everything after the pick is a function
of that ordered set, so N = 1, 2, 4, 8 give identical bits, ties included.

Exactness. All sums are sequential fp32 loops in the reference's order; divisions use div_rn;
the kernels launch with FMA contraction and libdevice flush-to-zero off. exp is the one
primitive not pinned: libdevice `__nv_expf` on the GPU, NumPy's float32 exp under the
interpreter (up to 3 ulp from torch's CPU exp). `kernel_exp` exposes this exact exp so a test
can replay the semantics bit for bit; against the torch.exp twin the probabilities follow the
tolerance row kernels.sampler.probs.

Limits: 1 ≤ top_k ≤ 64 when temperature > 0 (top_k = 0, the whole vocabulary, is not
supported); V < 2^31. Logit values are not checked (no host sync): NaN/+inf inputs, or logits
whose x / T overflows, give unspecified tokens (reference.sampling raises on them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.sampler_values import DeviceSampling
from reference.config import SamplingDefaults
from reference.rng import MASK32, Purpose

MAX_TOP_K = 64
SELECTS = ("rounds", "bitonic")
EMPTY = tl.constexpr(-(2**63) + 1)  # below every real key
U24 = tl.constexpr(5.9604644775390625e-08)  # 2^-24
_COMPILE = dict(enable_fp_fusion=False, enable_reflect_ftz=False)  # ignored by the interpreter


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
    BITONIC: tl.constexpr, VALS_FROM_PTR: tl.constexpr,
):
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
        if VALS_FROM_PTR:  # kernels/sampler_values.py: [temperature, top_p, apply_top_p]
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
    K: tl.constexpr, KP: tl.constexpr, GP: tl.constexpr, CP: tl.constexpr,
    FINAL: tl.constexpr, GREEDY: tl.constexpr, SEED_FROM_PTR: tl.constexpr,
    LIBDEVICE: tl.constexpr, BITONIC: tl.constexpr, VALS_FROM_PTR: tl.constexpr,
):
    row = tl.program_id(0)
    if row >= tl.load(n_live_ptr):
        return
    s = tl.program_id(1)
    base = cand_ptr + row * stride_cr + s * stride_cs  # groups [G, KP]
    gi = tl.arange(0, GP)
    gmax = tl.load(base + gi * stride_cg, mask=gi < G, other=EMPTY)  # [GP] slot 0 = group max
    grank = tl.sum((gmax[None, :] > gmax[:, None]).to(tl.int32), axis=1)
    tau = tl.max(tl.where(grank == K - 1, gmax, EMPTY), axis=0)
    tau = tl.where(G >= K, tau, EMPTY)
    c = tl.arange(0, CP)
    g = c // KP
    sl = c % KP
    ok = (g < G) & (sl < K)
    gm = tl.load(base + g * stride_cg, mask=ok, other=EMPTY)  # [CP] the group max of each slot
    keys = tl.load(base + g * stride_cg + sl, mask=ok & (gm >= tau), other=EMPTY)
    keys = tl.where(keys >= tau, keys, EMPTY)
    slot = tl.arange(0, KP)
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
def _exp_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, exp_f32(x, LIBDEVICE), mask=offs < n)


# --- launch configuration (pinned per shape; no autotuning: the path is bit-exact) -----------


@dataclass(frozen=True)
class SamplerLaunch:
    tile: int  # vocabulary entries per scan program (power of two)
    scan_warps: int
    merge_warps: int
    select: str = "rounds"  # top-K selection: "rounds" (K × max-and-remove) or "bitonic"

    def __post_init__(self) -> None:
        if self.tile < 16 or self.tile & (self.tile - 1):
            raise ValueError(f"SamplerLaunch.tile: power of two >= 16, got {self.tile}")
        if self.select not in SELECTS:
            raise ValueError(f"SamplerLaunch.select: one of {SELECTS}, got {self.select!r}")


def sampler_launch(shard_vocab: int) -> SamplerLaunch:
    """Tiles of 8192 on the real shapes (V = 160000: 20 tiles; a TP8 shard of 20000: 3 tiles)."""
    tile = min(8192, max(16, triton.next_power_of_2(shard_vocab)))
    return SamplerLaunch(tile=tile, scan_warps=8 if tile >= 4096 else 4, merge_warps=4)


# --- wrappers ---------------------------------------------------------------------------------


class SampleOut(NamedTuple):
    tokens: torch.Tensor  # [R] int64, the drawn token of each live row
    ids: torch.Tensor  # [R, W] int64, served candidates in draw order (served desc, id asc)
    probs: torch.Tensor  # [R, W] fp32 served probabilities, 0 after the kept prefix


def _fail(msg: str):
    raise ValueError(f"kernels.sampler: {msg}")


def _split(params, vocab: int, device):
    """(host parameters for the checks and scalar arguments, DeviceSampling.values or None).
    A DeviceSampling's values were validated on the host when written; its host stand-in
    carries only its shape (top_k, greedy) — the kernels read temperature and top-p from values."""
    if isinstance(params, DeviceSampling):
        _check("params.values", params.values, 1, (torch.float32,), device)
        if params.values.numel() != 3:
            _fail(f"params.values must hold 3 values, got {params.values.numel()}")
        stand_in = SamplingDefaults(0.0 if params.greedy else 1.0, params.top_k, 1.0)
        return stand_in, params.values
    return params, None


def _check_params(params: SamplingDefaults, vocab: int) -> int:
    """The top-K width K of the kernels (1 when greedy)."""
    if not isinstance(params, SamplingDefaults):
        _fail(f"params must be a SamplingDefaults or a DeviceSampling, got "
              f"{type(params).__name__}")
    try:
        params.validate(vocab, where="params")
    except ValueError as e:
        _fail(str(e))
    if params.temperature == 0.0:
        return 1
    if not 1 <= params.top_k <= MAX_TOP_K:
        _fail(f"params.top_k={params.top_k}: the kernel supports 1 <= top_k <= {MAX_TOP_K} when "
              "temperature > 0 (top_k = 0, the whole vocabulary, is not supported)")
    return params.top_k


def _check(name: str, t, dims: int, dtypes, device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        _fail(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        _fail(f"{name} must be on {device}, got {t.device}")


def _n_live(n_live, rows: int, device) -> torch.Tensor:
    if n_live is None:
        return torch.full((1,), rows, dtype=torch.int32, device=device)
    _check("n_live", n_live, 1, (torch.int32,), device)
    if n_live.numel() != 1:
        _fail(f"n_live must hold one element, got shape {tuple(n_live.shape)}")
    return n_live


def seed_args(seed, device) -> tuple[int, torch.Tensor | None]:
    """(scalar, pointer) kernel arguments for a uint64 seed given as an int or as a device
    int64 tensor [1] holding its bits (a tensor keeps the seed out of a captured CUDA graph)."""
    if isinstance(seed, torch.Tensor):
        _check("seed", seed, 1, (torch.int64,), device)
        if seed.numel() != 1:
            _fail(f"seed tensor must hold one element, got shape {tuple(seed.shape)}")
        return 0, seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        _fail(f"seed must be an integer in [0, 2^64) or an int64 device tensor [1], got {seed!r}")
    return seed, None


def _rng_words(purpose, index) -> tuple[int, int]:
    try:
        purpose = Purpose(purpose)
    except ValueError:
        _fail(f"purpose must be one of {list(Purpose)}, got {purpose!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MASK32:
        _fail(f"index must be an integer in [0, 2^32), got {index!r}")
    return int(purpose), index


def _tiles(shard_vocab: int, kp: int, cfg: SamplerLaunch) -> int:
    tiles = triton.cdiv(shard_vocab, cfg.tile)
    if triton.next_power_of_2(tiles * kp) > 8192:
        _fail(f"{tiles} tiles x {kp} candidate slots exceed the merge's 8192; use a larger "
              f"SamplerLaunch.tile than {cfg.tile}")
    return tiles


def _scan(x, k, kp, greedy, temperature, shards, n_live, cfg, id_offset=0, values=None):
    """Launch 1: per-tile top-K keys, cand [R, N, T, KP]. values: DeviceSampling.values."""
    R, V = x.shape
    base, rem = divmod(V, shards)
    tiles = _tiles(base + (rem > 0), kp, cfg)
    cand = torch.empty(R, shards, tiles, kp, dtype=torch.int64, device=x.device)
    _scan_kernel[(R, shards, tiles)](
        x, cand, n_live, float(temperature), values if values is not None else x, id_offset,
        base, rem, x.stride(0), *cand.stride()[:3],
        K=k, KP=kp, TILE=cfg.tile, GREEDY=greedy, BITONIC=cfg.select == "bitonic",
        VALS_FROM_PTR=values is not None, num_warps=cfg.scan_warps, **_COMPILE,
    )
    return cand


def _merge(cand, groups, n_live, k, kp, cfg, *, final=None, keys_out=None, values=None):
    """Launch 2/3 over candidates [R, S, G, KP]: keys_out [R, S, KP] (local) or final sampling."""
    R, S = cand.shape[0], cand.shape[1]
    cp = triton.next_power_of_2(groups * kp)
    if cp > 8192:
        _fail(f"{groups} candidate groups x {kp} slots exceed the merge's 8192")
    dev = cand.device
    if final is None:
        tok = ids = probs = pos = torch.empty(0, dtype=torch.int64, device=dev)
        seed, seed_t, top_p, apply, purpose, index, greedy = 0, None, 1.0, 0, 0, 0, False
        si, sp = 0, 0
    else:
        tok, ids, probs, pos, seed, seed_t, top_p, apply, purpose, index, greedy = final
        si, sp = ids.stride(0), probs.stride(0)
    if keys_out is None:
        keys_out = tok
        sk = (0, 0)
    else:
        sk = keys_out.stride()[:2]
    _merge_kernel[(R, S)](
        cand, cand.stride(0), cand.stride(1), cand.stride(2), groups,
        keys_out, *sk, tok, ids, probs, si, sp,
        pos, seed, seed_t if seed_t is not None else tok, n_live, float(top_p), apply,
        values if values is not None else cand, purpose, index,
        K=k, KP=kp, GP=triton.next_power_of_2(groups), CP=cp, FINAL=final is not None,
        GREEDY=greedy, SEED_FROM_PTR=seed_t is not None, LIBDEVICE=not _interpreting(),
        BITONIC=cfg.select == "bitonic", VALS_FROM_PTR=values is not None,
        num_warps=cfg.merge_warps, **_COMPILE,
    )


def _outputs(out, rows: int, width: int, device) -> SampleOut:
    if out is None:
        return SampleOut(
            torch.empty(rows, dtype=torch.int64, device=device),
            torch.empty(rows, width, dtype=torch.int64, device=device),
            torch.empty(rows, width, dtype=torch.float32, device=device),
        )
    if not isinstance(out, SampleOut):
        _fail("out must be a SampleOut(tokens, ids, probs)")
    for name, t, shape, dt in (("out.tokens", out.tokens, (rows,), torch.int64),
                               ("out.ids", out.ids, (rows, width), torch.int64),
                               ("out.probs", out.probs, (rows, width), torch.float32)):
        _check(name, t, len(shape), (dt,), device)
        if tuple(t.shape) != shape:
            _fail(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            _fail(f"{name} must have unit stride in its last dim, got {t.stride()}")
    return out


def _check_positions(positions, rows: int, device) -> None:
    _check("positions", positions, 1, (torch.int64, torch.int32), device)
    if positions.shape[0] != rows:
        _fail(f"positions must be [R={rows}], got {tuple(positions.shape)}")


def sample(
    logits: torch.Tensor,  # [R, V] fp32, unit column stride
    params: SamplingDefaults | DeviceSampling,
    seed,  # int in [0, 2^64) or device int64 [1]
    positions: torch.Tensor,  # [R] int64/int32 device; row r uses (seed, positions[r], ...)
    purpose: Purpose = Purpose.TARGET_SAMPLE,
    index: int = 0,
    *,
    shards: int = 1,  # virtual TP ranks; any N gives the same bits
    n_live: torch.Tensor | None = None,  # device int32 [1]; rows ≥ n_live are left untouched
    out: SampleOut | None = None,
    config: SamplerLaunch | None = None,
) -> SampleOut:
    """Served top-k/top-p candidates of each row and the token drawn from them (W = top_k, or
    1 when greedy). Twin: reference.sampling_twins.sample_ref."""
    _check("logits", logits, 2, (torch.float32,), None)
    R, V = logits.shape
    if R < 1 or V < 1:
        _fail(f"logits must be [R, V] with R, V >= 1, got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        _fail(f"logits must have unit column stride, got strides {logits.stride()}")
    if V >= 2**31:
        _fail(f"vocabulary {V} must be < 2^31")
    dev = logits.device
    params, values = _split(params, V, dev)
    k = _check_params(params, V)
    kp = max(2, triton.next_power_of_2(k))
    _check_positions(positions, R, dev)
    seed_v, seed_t = seed_args(seed, dev)
    purpose_v, index_v = _rng_words(purpose, index)
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= min(V, 64):
        _fail(f"shards must be an integer in [1, min(V={V}, 64)], got {shards!r}")
    n = _n_live(n_live, R, dev)
    greedy = params.temperature == 0.0
    res = _outputs(out, R, k, dev)
    cfg = config or sampler_launch(-(-V // shards))
    cand = _scan(logits, k, kp, greedy, params.temperature or 1.0, shards, n, cfg, values=values)
    if shards > 1:
        local = torch.empty(R, shards, kp, dtype=torch.int64, device=dev)
        _merge(cand, cand.shape[2], n, k, kp, cfg, keys_out=local)
        cand = local[:, None]  # [R, 1, N, KP]: the shards' lists are the final merge's groups
    final = (res.tokens, res.ids, res.probs, positions, seed_v, seed_t, params.top_p,
             int(params.top_p < 1.0), purpose_v, index_v, greedy)
    _merge(cand, cand.shape[2], n, k, kp, cfg, final=final, values=values)
    return res


def topk_candidates(
    logits: torch.Tensor,  # [R, Vs] fp32, unit column stride: this rank's vocabulary slice
    params: SamplingDefaults | DeviceSampling,
    vocab_offset: int,  # global id of column 0
    vocab: int,  # the full vocabulary V (for the parameter check)
    *,
    n_live: torch.Tensor | None = None,
    config: SamplerLaunch | None = None,
) -> torch.Tensor:
    """One TP rank's top-K order keys [R, KP] int64 with global ids (launches 1 and 2); the
    all-gathered [R, N, KP] keys go to `sample_from_candidates`."""
    _check("logits", logits, 2, (torch.float32,), None)
    R, V = logits.shape
    if R < 1 or V < 1 or logits.stride(1) != 1:
        _fail(f"logits must be [R, Vs] with R, Vs >= 1 and unit column stride, got shape "
              f"{tuple(logits.shape)} strides {logits.stride()}")
    if isinstance(vocab_offset, bool) or not isinstance(vocab_offset, int) or not (
        0 <= vocab_offset and vocab_offset + V <= vocab < 2**31
    ):
        _fail(f"vocab_offset={vocab_offset!r}: need 0 <= offset and offset + Vs={V} <= "
              f"vocab={vocab} < 2^31")
    params, values = _split(params, vocab, logits.device)
    k = _check_params(params, vocab)
    kp = max(2, triton.next_power_of_2(k))
    n = _n_live(n_live, R, logits.device)
    cfg = config or sampler_launch(V)
    cand = _scan(logits, k, kp, params.temperature == 0.0, params.temperature or 1.0, 1, n, cfg,
                 id_offset=vocab_offset, values=values)
    keys = torch.empty(R, 1, kp, dtype=torch.int64, device=logits.device)
    _merge(cand, cand.shape[2], n, k, kp, cfg, keys_out=keys)
    return keys[:, 0]


def sample_from_candidates(
    keys: torch.Tensor,  # [R, G, KP] int64 order keys (e.g. all-gathered topk_candidates)
    params: SamplingDefaults | DeviceSampling,
    seed,
    positions: torch.Tensor,  # [R]
    purpose: Purpose = Purpose.TARGET_SAMPLE,
    index: int = 0,
    *,
    vocab: int,
    n_live: torch.Tensor | None = None,
    out: SampleOut | None = None,
    config: SamplerLaunch | None = None,
) -> SampleOut:
    """Launch 3 on gathered candidate lists: the global top-K, top-p and the draw (as `sample`).
    keys may be any strided view, e.g. an all-gather's [N, R, KP] permuted to [R, N, KP]."""
    _check("keys", keys, 3, (torch.int64,), None)
    R, G, KPk = keys.shape
    dev = keys.device
    params, values = _split(params, vocab, dev)
    k = _check_params(params, vocab)
    kp = max(2, triton.next_power_of_2(k))
    if KPk != kp or keys.stride(2) != 1 or R < 1 or G < 1:
        _fail(f"keys must be [R, G, KP={kp}] with unit slot stride, got shape "
              f"{tuple(keys.shape)} strides {keys.stride()}")
    _check_positions(positions, R, dev)
    seed_v, seed_t = seed_args(seed, dev)
    purpose_v, index_v = _rng_words(purpose, index)
    n = _n_live(n_live, R, dev)
    res = _outputs(out, R, k, dev)
    final = (res.tokens, res.ids, res.probs, positions, seed_v, seed_t, params.top_p,
             int(params.top_p < 1.0), purpose_v, index_v, params.temperature == 0.0)
    _merge(keys[:, None], G, n, k, kp, config or sampler_launch(vocab), final=final,
           values=values)
    return res


def kernel_exp(x: torch.Tensor) -> torch.Tensor:
    """The exp the sampler uses on x's device (libdevice on the GPU, NumPy's under the
    interpreter), so tests can replay the sampling semantics bit for bit. x fp32 [n]."""
    _check("x", x, 1, (torch.float32,), None)
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _exp_kernel[(triton.cdiv(x.numel(), 1024),)](
            x, y, x.numel(), BLOCK=1024, LIBDEVICE=not _interpreting(), **_COMPILE)
    return y
