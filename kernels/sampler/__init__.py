"""Fused temperature / top-k / top-p sampler with the counter-based draw (kernel family 6).
Twin: reference/twins/sampler.py `sample_ref` (reference.sampling.served_candidates + draw +
reference.rng.uniforms); results equal it bit for bit except through exp (see
kernels/sampler/device.py).

Dimension letters: R rows (≤ 8 in use), V vocabulary, N shards (virtual TP ranks), Vs = the
vocabulary of one shard, T tiles per shard, K = top_k (≤ 64), KP = next power of two ≥ K,
G candidate groups of one merge (tiles, or shards), W output width (K, or 1 when greedy).

The kernels, their launches and the exactness argument live in kernels/sampler/device.py, the
argument checks in kernels/sampler/checks.py. A TP rank runs launches 1 and 2
(`topk_candidates`) and all-gathers the keys; `sample_from_candidates` runs launch 3 on them.
Sharded and unsharded runs pick the same key set (a total order has one top-K and every
shard's top-K contains that shard's share of it), and everything after the pick is a function
of that ordered set, so N = 1, 2, 4, 8 give identical bits, ties included.

Limits: 1 ≤ top_k ≤ 64 when temperature > 0 (top_k = 0, the whole vocabulary, is not
supported); V < 2^31. Logit values are not checked (no host sync): NaN/+inf inputs, or logits
whose x / T overflows, give unspecified tokens (reference.sampling raises on them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from kernels.launch import launch_opts
from kernels.sampler.checks import (
    _check,
    _check_positions,
    _fail,
    _n_live,
    _rng_words,
    _split,
    seed_args,
)
from kernels.sampler.device import _COMPILE, _exp_kernel, _merge_kernel, _scan_kernel
from kernels.sampler.values import DeviceSampling
from kernels.twin import twin
from reference.config import SamplingDefaults
from reference.op_types import SampleOut
from reference.rng import Purpose
from reference.twins import sampler as _twins

MAX_TOP_K = 64
MAX_GROUPS = 1024  # candidate groups (tiles of a shard, or shards) one merge ranks: [GP, SP]
SELECTS = ("rounds", "bitonic")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
    """Tiles of 2048, 4 warps, on the real shapes (V = 160000: 79 tiles; a TP8 shard of 20000:
    10 tiles): a scan program's serial block reductions shrink with its tile, and the merge
    gathers only the K groups that can hold the top K, whatever their number.
    reports/benchmarks/h100-2026-12-05/ (H100, CUDA graphs): `bench_sampler --sweep` 8 × 160000
    39.6 µs vs 45.5 µs with tiles of 8192 / 8 warps, one TP8 rank step 28.4 vs 39.2 µs; inside
    the rank round (`benchmarks.rank --launch sampler.tile=2048,sampler.scan_warps=4`,
    alternating) rounds 0.8–1.2 % faster (6 of 6 pairs, widths 6 and 8, 1K–16K). The bitonic
    selection with 8 merge warps was faster on the rank step alone (25.5 µs) but not in the
    round (0.3–0.8 %)."""
    tile = min(2048, max(16, triton.next_power_of_2(shard_vocab)))
    return SamplerLaunch(tile=tile, scan_warps=4, merge_warps=4)


# --- wrappers ---------------------------------------------------------------------------------


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


def _tiles(shard_vocab: int, kp: int, cfg: SamplerLaunch) -> int:
    tiles = triton.cdiv(shard_vocab, cfg.tile)
    if tiles > MAX_GROUPS:
        _fail(f"{tiles} tiles of {cfg.tile} exceed the merge's {MAX_GROUPS} candidate groups; "
              f"use a larger SamplerLaunch.tile")
    return tiles


def _scan(x, k, kp, greedy, temperature, shards, n_live, cfg, id_offset=0, values=None, *,
          pdl=False):
    """Launch 1: per-tile top-K keys, cand [R, N, T, KP]. values: DeviceSampling.values."""
    R, V = x.shape
    base, rem = divmod(V, shards)
    tiles = _tiles(base + (rem > 0), kp, cfg)
    cand = torch.empty(R, shards, tiles, kp, dtype=torch.int64, device=x.device)
    _scan_kernel[(R, shards, tiles)](
        x, cand, n_live, float(temperature), values if values is not None else x, id_offset,
        base, rem, x.stride(0), *cand.stride()[:3],
        K=k, KP=kp, TILE=cfg.tile, GREEDY=greedy, BITONIC=cfg.select == "bitonic",
        VALS_FROM_PTR=values is not None, num_warps=cfg.scan_warps,
        **launch_opts(pdl, **_COMPILE),
    )
    return cand


def _merge(cand, groups, n_live, k, kp, cfg, *, final=None, keys_out=None, values=None,
           pdl=False):
    """Launch 2/3 over candidates [R, S, G, KP]: keys_out [R, S, KP] (local) or final sampling."""
    R, S = cand.shape[0], cand.shape[1]
    gp = triton.next_power_of_2(groups)
    if groups > MAX_GROUPS:
        _fail(f"{groups} candidate groups exceed the merge's {MAX_GROUPS}")
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
        K=k, KP=kp, GP=gp, SP=min(gp, kp), FINAL=final is not None,
        GREEDY=greedy, SEED_FROM_PTR=seed_t is not None, LIBDEVICE=not _interpreting(),
        BITONIC=cfg.select == "bitonic", VALS_FROM_PTR=values is not None,
        num_warps=cfg.merge_warps, **launch_opts(pdl, **_COMPILE),
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


@twin(_twins.sample_ref)
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
    pdl: bool = False,
) -> SampleOut:
    """Served top-k/top-p candidates of each row and the token drawn from them (W = top_k, or
    1 when greedy). Twin: reference.twins.sampler.sample_ref.
    pdl: programmatic dependent launch (kernels/launch.py)."""
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
    cand = _scan(logits, k, kp, greedy, params.temperature or 1.0, shards, n, cfg, values=values,
                 pdl=pdl)
    if shards > 1:
        local = torch.empty(R, shards, kp, dtype=torch.int64, device=dev)
        _merge(cand, cand.shape[2], n, k, kp, cfg, keys_out=local, pdl=pdl)
        cand = local[:, None]  # [R, 1, N, KP]: the shards' lists are the final merge's groups
    final = (res.tokens, res.ids, res.probs, positions, seed_v, seed_t, params.top_p,
             int(params.top_p < 1.0), purpose_v, index_v, greedy)
    _merge(cand, cand.shape[2], n, k, kp, cfg, final=final, values=values, pdl=pdl)
    return res


def topk_candidates(
    logits: torch.Tensor,  # [R, Vs] fp32, unit column stride: this rank's vocabulary slice
    params: SamplingDefaults | DeviceSampling,
    vocab_offset: int,  # global id of column 0
    vocab: int,  # the full vocabulary V (for the parameter check)
    *,
    n_live: torch.Tensor | None = None,
    config: SamplerLaunch | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """One TP rank's top-K order keys [R, KP] int64 with global ids (launches 1 and 2); the
    all-gathered [R, N, KP] keys go to `sample_from_candidates`.
    pdl: programmatic dependent launch (kernels/launch.py)."""
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
                 id_offset=vocab_offset, values=values, pdl=pdl)
    keys = torch.empty(R, 1, kp, dtype=torch.int64, device=logits.device)
    _merge(cand, cand.shape[2], n, k, kp, cfg, keys_out=keys, pdl=pdl)
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
    pdl: bool = False,
) -> SampleOut:
    """Launch 3 on gathered candidate lists: the global top-K, top-p and the draw (as `sample`).
    keys may be any strided view, e.g. an all-gather's [N, R, KP] permuted to [R, N, KP].
    pdl: programmatic dependent launch (kernels/launch.py)."""
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
           values=values, pdl=pdl)
    return res


def kernel_exp(x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """The exp the sampler uses on x's device (libdevice on the GPU, NumPy's under the
    interpreter), so tests can replay the sampling semantics bit for bit. x fp32 [n].
    pdl: programmatic dependent launch (kernels/launch.py)."""
    _check("x", x, 1, (torch.float32,), None)
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _exp_kernel[(triton.cdiv(x.numel(), 1024),)](
            x, y, x.numel(), BLOCK=1024, LIBDEVICE=not _interpreting(),
            **launch_opts(pdl, **_COMPILE))
    return y
