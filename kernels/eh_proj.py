"""A later draft depth's entry inside its projection: y = eh · Wᵀ with the operand
eh = [bf16(rms_norm(embed[tok], enorm)) | bf16(rms_norm(hprev, hnorm))] built in the GEMM's own
programs instead of by a separate entry launch (kernels/draft_entry.py) writing eh to memory.

Grid and split-K are kernels/linear.py's `linear_bf16_f32` (program (t, s): channel tile t over
column blocks [s·KB, (s+1)·KB) of K = 2H, FP32 partials summed by its `_reduce_splits_kernel` in
the order s = 0, 1, …). Each program first computes, for every live row r < n, the row's sources
(token slot and hidden row, clamped as in the entry launch) and the two inverse RMS values with
the entry launch's own helper over the whole row (`_inv_rms`, BLOCK_H = next_pow2(H), num_warps 4,
FMA contraction off — the same reduction, so the same bits); then, per column block, the operand
tile = bf16((x · inv) · norm_w) for columns < H from the embedding row, ≥ H from the hidden row.
Every program repeats the 2·H loads per live row (from L2: a later depth has one live row), and in
exchange the [R, 2H] operand never goes to memory and one launch per depth disappears.

Bit-exact with draft_entry followed by linear_bf16_f32 on the same launch configuration (the
operand values and the dot products are the same). Program (0, 0) also writes positions:
pos[r] = pos_base + r for r < n, −1 after. Rows ≥ n of the output are never written.

Dimension letters: R rows (buffer ≤ 16), n live rows, H hidden, N output channels (H for the
draft), K = 2H, S splits, BN channels per program, BR = 16 rows on the MMA's narrow side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_tensor
from kernels.draft_entry import _base, _row_sources, _unit_cols, entry_args
from kernels.fp8 import bf16_rne
from kernels.launch import launch_opts, pdl_enter
from kernels.linear import (
    _OUT_DTYPES,
    BLOCK_R,
    LinearLaunch,
    _check_out,
    _finish,
    _interpreting,
    _partials_buffer,
    _store_tile,
    dot_bf16,
    linear_bf16_launch,
    split_plan,
)
from kernels.tails import _inv_rms
from kernels.twin import twin
from reference.twins import eh_proj as _twins

_COMPILE = dict(enable_fp_fusion=False)  # the entry launch's rounding (no FMA contraction)


@triton.jit
def _eh_proj_kernel(
    tok_ptr, tok_base_ptr, hid_ptr, hid_base_ptr, pos_base_ptr, n_live_ptr,
    embed_ptr, enorm_ptr, hnorm_ptr, w_ptr, out_ptr, pos_ptr,
    tok_add, hid_add, pos_add, tok_max, hid_rows, vocab, R, N,
    stride_t, stride_h, stride_e, stride_wn, stride_wk, stride_os, stride_or, stride_on, eps,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, OUT_BF16: tl.constexpr,
    INTERPRET: tl.constexpr, TOK_PTR: tl.constexpr, HID_PTR: tl.constexpr,
    POS_PTR: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n = tl.minimum(tl.load(n_live_ptr), R)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_R)
    live = rows < n
    if (tl.program_id(0) == 0) & (split == 0):
        p = _base(pos_base_ptr, pos_add, POS_PTR) + rows
        tl.store(pos_ptr + rows, tl.where(live, p, -1).to(tl.int32), mask=rows < R)
    # per live row: embedding row offset, hidden row offset, the two inverse RMS values [BR]
    e_off = tl.zeros([BLOCK_R], tl.int64)
    h_off = tl.zeros([BLOCK_R], tl.int64)
    inv_e = tl.zeros([BLOCK_R], tl.float32)
    inv_h = tl.zeros([BLOCK_R], tl.float32)
    cols = tl.arange(0, BLOCK_H)
    m = cols < HIDDEN
    for r in range(BLOCK_R):  # a loop, not unrolled; rows ≥ n skip (the interpreter cannot
        if r < n:             # take a loaded bound for range())
            tok, hrow = _row_sources(r, tok_ptr, tok_base_ptr, hid_base_ptr, tok_add, hid_add,
                                     tok_max, hid_rows, vocab, stride_t, TOK_PTR, HID_PTR)
            e = tl.load(embed_ptr + tok * stride_e + cols, mask=m, other=0.0).to(tl.float32)
            x = tl.load(hid_ptr + hrow * stride_h + cols, mask=m, other=0.0).to(tl.float32)
            at = rows == r
            e_off = tl.where(at, tok * stride_e, e_off)
            h_off = tl.where(at, hrow * stride_h, h_off)
            inv_e = tl.where(at, _inv_rms(e, eps, HIDDEN), inv_e)
            inv_h = tl.where(at, _inv_rms(x, eps, HIDDEN), inv_h)
    c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cm = c < N
    w_rows = w_ptr + c.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for i in range(KB):
        kk = (split * KB + i) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK] columns of eh
        in_e = kk < HIDDEN
        in_h = (kk >= HIDDEN) & (kk < 2 * HIDDEN)
        kh = kk - HIDDEN
        me, mh = in_e[:, None] & live[None, :], in_h[:, None] & live[None, :]
        xe = tl.load(embed_ptr + e_off[None, :] + kk[:, None], mask=me, other=0.0)
        xh = tl.load(hid_ptr + h_off[None, :] + kh[:, None], mask=mh, other=0.0)
        x = tl.where(in_e[:, None], xe.to(tl.float32), xh.to(tl.float32))  # [BK, BR]
        inv = tl.where(in_e[:, None], inv_e[None, :], inv_h[None, :])
        wn = tl.where(in_e, tl.load(enorm_ptr + kk, mask=in_e, other=0.0).to(tl.float32),
                      tl.load(hnorm_ptr + kh, mask=in_h, other=0.0).to(tl.float32))
        xt = bf16_rne(x * inv * wn[:, None])  # [BK, BR] bf16: the entry launch's eh values
        w = tl.load(w_rows + kk[None, :] * stride_wk, mask=cm[:, None] & (in_e | in_h)[None, :],
                    other=0.0)  # [BN, BK] bf16
        acc = dot_bf16(acc, w, xt, INTERPRET)
    _store_tile(out_ptr + split * stride_os, acc, rows, live, c, cm, stride_or, stride_on,
                OUT_BF16)


@twin(_twins.eh_proj_ref)
def eh_proj(
    tokens_src: torch.Tensor,  # [P] int64 token ids by slot
    tok_base,  # int | [1] int32/int64: slot of row 0's token
    tok_max: int,  # last slot a row may read, 0 ≤ tok_max < P
    hid_src: torch.Tensor,  # [S, H] bf16
    hid_base,  # int | [1] int32/int64: hid_src row of row 0 (clamped to [0, S − 1] per row)
    pos_base,  # int | [1] int32/int64: position of row 0
    n_live: torch.Tensor,  # [1] int32 live rows
    embed: torch.Tensor,  # [V, H] bf16
    enorm: torch.Tensor,  # [H]
    hnorm: torch.Tensor,  # [H]
    eps: float,
    weight: torch.Tensor,  # [N, 2H] bf16 (eh_proj), any strides
    pos_out: torch.Tensor,  # [R] int32, R ≤ 16
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,  # [R, N] out_dtype, unit stride in N
    partials: torch.Tensor | None = None,  # [S, R, N] fp32 workspace when S > 1
    config: LinearLaunch | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (out [R, N], pos_out): draft_entry then linear_bf16_f32 in one GEMM launch (+ the split
    reduction when S > 1). Live rows of out and every row of pos_out written; capturable.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    check_tensor("eh_proj: pos_out", pos_out, dims=1, dtypes=(torch.int32,))
    R = pos_out.shape[0]
    if not 1 <= R <= BLOCK_R:
        raise ValueError(f"eh_proj: pos_out has {R} rows; the row buffer holds 1..{BLOCK_R}")
    a = entry_args(tokens_src, tok_base, tok_max, hid_src, hid_base, pos_base, n_live, embed,
                   enorm, hnorm, R)
    dev, H = embed.device, a.H
    _unit_cols("pos_out", pos_out, (R,), (torch.int32,), dev)
    check_tensor("eh_proj: weight", weight, dims=2, dtypes=(torch.bfloat16,), device=dev)
    big_n = weight.shape[0]
    if weight.shape[1] != 2 * H or big_n < 1:
        raise ValueError(f"eh_proj: weight must be [N, 2H = {2 * H}], got {tuple(weight.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    cfg = config or linear_bf16_launch(big_n, 2 * H)
    if cfg.num_warps != 4:
        raise ValueError(f"eh_proj: config.num_warps must be 4 (the entry launch's, so that each "
                         f"row's sum of squares reduces in the same order), got {cfg.num_warps}")
    s, kb = split_plan(-(-2 * H // cfg.block_k), cfg.split_k)
    if out is None:
        out = torch.empty(R, big_n, dtype=out_dtype, device=dev)
    _check_out("out", out, (R, big_n), out_dtype, dev)
    dst = out if s == 1 else _partials_buffer(partials, s, R, big_n, dev)
    ptrs, ints, consts = a.launch
    _eh_proj_kernel[(triton.cdiv(big_n, cfg.block_n), s)](
        *ptrs, weight, dst, pos_out, *ints, R, big_n,
        tokens_src.stride(0), hid_src.stride(0), embed.stride(0), *weight.stride(),
        dst.stride(0) if s > 1 else 0, dst.stride(-2), dst.stride(-1), float(eps),
        HIDDEN=H, BLOCK_H=triton.next_power_of_2(H), KB=kb, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, BLOCK_R=BLOCK_R, OUT_BF16=s == 1 and out_dtype == torch.bfloat16,
        INTERPRET=_interpreting(), **consts, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch_opts(pdl, **_COMPILE),
    )
    if s > 1:
        _finish(dst, a.n, out, s, R, big_n, out_dtype, cfg, pdl=pdl)
    return out, pos_out
