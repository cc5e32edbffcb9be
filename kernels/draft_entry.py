"""The draft's entry launch: one launch builds a draft depth's eh_proj operand and its positions.

For live rows r < n (n = min(n_live, R)), one program per buffer row:
  tok = tokens_src[clamp(tok_base + r, 0, tok_max)], then clamped to [0, V − 1]
  hrow = clamp(hid_base + r, 0, S − 1)
  eh[r, :H] = bf16(rms_norm(embed[tok], enorm)),  eh[r, H:] = bf16(rms_norm(hid_src[hrow], hnorm))
  pos[r] = pos_base + r
Padding rows r ≥ n: pos[r] = −1; eh[r] is neither read nor written (later kernels take n).

Out-of-range ids are *clamped*, never masked: a token outside [0, V) reads embed[0] or
embed[V − 1] (the round records such a draft as a fault; the row's values are then irrelevant),
and a source index outside [0, tok_max] reads the nearest end. Either way no load leaves the
tensors.

The norms are those of kernels/rows.py's norm row kernel (one program per row, the same `_rms`
and `_bf16` helpers, BLOCK_H = next_pow2(H), num_warps 4, FMA contraction off), so each half is
bit-identical to ops.norm_rows on the gathered rows. Twin: iquestrt/ops.py TwinOps.draft_entry
(gather, clamp, reference.ops.rms_norm row by row); vs the twin only the order of each sum of
squares differs (tolerance row kernels.rows.norm bf16).

The three base scalars (tok_base, hid_base, pos_base) are each a device tensor of one int32 or
int64 element (read inside the kernel: capturable) or a host int (a launch constant).

Dimension letters: R rows (buffer), n live rows, P token slots, S hidden source rows, H hidden,
V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import check_tensor, live_count
from kernels.launch import launch_opts, pdl_enter
from kernels.tails import _bf16, _rms
from kernels.twin import twin
from reference.twins import draft_entry as _twins

_COMPILE = dict(enable_fp_fusion=False)
_INDEX = (torch.int32, torch.int64)


@triton.jit
def _base(ptr, add, FROM_PTR: tl.constexpr):
    v = tl.zeros([], tl.int64) + add
    if FROM_PTR:
        v += tl.load(ptr).to(tl.int64)
    return v


@triton.jit
def _row_sources(row, tok_ptr, tok_base_ptr, hid_base_ptr, tok_add, hid_add, tok_max, hid_rows,
                 vocab, stride_t, TOK_PTR: tl.constexpr, HID_PTR: tl.constexpr):
    """Row `row`'s token id and hidden source row, both clamped (see the module docstring)."""
    src = _base(tok_base_ptr, tok_add, TOK_PTR) + row
    src = tl.minimum(tl.maximum(src, 0), tok_max)
    tok = tl.load(tok_ptr + src * stride_t).to(tl.int64)
    tok = tl.minimum(tl.maximum(tok, 0), vocab - 1)
    hrow = _base(hid_base_ptr, hid_add, HID_PTR) + row
    return tok, tl.minimum(tl.maximum(hrow, 0), hid_rows - 1)


@triton.jit
def _draft_entry_kernel(
    tok_ptr, tok_base_ptr, hid_ptr, hid_base_ptr, pos_base_ptr, n_live_ptr,
    embed_ptr, enorm_ptr, hnorm_ptr, eh_ptr, pos_ptr,
    tok_add, hid_add, pos_add, tok_max, hid_rows, vocab,
    stride_t, stride_h, stride_e, stride_eh, eps,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
    TOK_PTR: tl.constexpr, HID_PTR: tl.constexpr, POS_PTR: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    n = tl.load(n_live_ptr)
    p = _base(pos_base_ptr, pos_add, POS_PTR) + row
    tl.store(pos_ptr + row, tl.where(row < n, p, -1).to(tl.int32))
    if row >= n:
        return
    tok, hrow = _row_sources(row, tok_ptr, tok_base_ptr, hid_base_ptr, tok_add, hid_add,
                             tok_max, hid_rows, vocab, stride_t, TOK_PTR, HID_PTR)
    cols = tl.arange(0, BLOCK_H)
    m = cols < HIDDEN
    out = eh_ptr + row.to(tl.int64) * stride_eh + cols
    e = tl.load(embed_ptr + tok * stride_e + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(enorm_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out, _bf16(_rms(e, w, eps, HIDDEN)).to(tl.bfloat16), mask=m)
    x = tl.load(hid_ptr + hrow * stride_h + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(hnorm_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out + HIDDEN, _bf16(_rms(x, w, eps, HIDDEN)).to(tl.bfloat16), mask=m)


def _scalar(name: str, x, device) -> tuple[torch.Tensor | None, int]:
    """A base scalar → (device tensor to read or None, host constant to add)."""
    if isinstance(x, bool) or not isinstance(x, (int, torch.Tensor)):
        raise ValueError(f"draft_entry: {name} must be an int or a device int32/int64 tensor of "
                         f"one element, got {type(x).__name__}")
    if isinstance(x, int):
        if not -(2**62) < x < 2**62:
            raise ValueError(f"draft_entry: {name} = {x} out of range")
        return None, x
    check_tensor(f"draft_entry: {name}", x, dtypes=_INDEX, device=device)
    if x.numel() != 1:
        raise ValueError(f"draft_entry: {name} must have one element, got shape {tuple(x.shape)}")
    return x, 0


def _unit_cols(name: str, t: torch.Tensor, shape, dtypes, device) -> None:
    check_tensor(f"draft_entry: {name}", t, shape=shape, dtypes=dtypes, device=device)
    if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"draft_entry: {name} needs unit column stride, got strides {t.stride()}")
    if t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"draft_entry: {name} must be contiguous, got stride {t.stride()}")


@dataclass(frozen=True)
class EntryArgs:
    """Validated sources of an entry: sizes, the live count and each base as (device tensor or
    None, host constant); `launch` = the kernel arguments both entry kernels take first."""

    V: int
    H: int
    n: torch.Tensor
    launch: tuple


def entry_args(tokens_src, tok_base, tok_max, hid_src, hid_base, pos_base, n_live, embed, enorm,
               hnorm, rows: int) -> EntryArgs:
    """Checks every source of an entry over a buffer of `rows` rows (errors name the argument)."""
    check_tensor("draft_entry: embed", embed, dims=2, dtypes=(torch.bfloat16,))
    dev = embed.device
    V, H = embed.shape
    if V < 1 or H < 1:
        raise ValueError(f"draft_entry: embed must be non-empty, got shape {tuple(embed.shape)}")
    _unit_cols("embed", embed, (V, H), (torch.bfloat16,), dev)
    check_tensor("draft_entry: tokens_src", tokens_src, dims=1, dtypes=(torch.int64,), device=dev)
    P = tokens_src.shape[0]
    if isinstance(tok_max, bool) or not isinstance(tok_max, int) or not 0 <= tok_max < P:
        raise ValueError(f"draft_entry: tok_max {tok_max!r} outside [0, P − 1 = {P - 1}] "
                         f"(tokens_src has {P} slots)")
    check_tensor("draft_entry: hid_src", hid_src, dims=2, dtypes=(torch.bfloat16,), device=dev)
    S = hid_src.shape[0]
    if S < 1:
        raise ValueError("draft_entry: hid_src has no rows")
    _unit_cols("hid_src", hid_src, (S, H), (torch.bfloat16,), dev)
    for name, w in (("enorm", enorm), ("hnorm", hnorm)):
        _unit_cols(name, w, (H,), (torch.bfloat16, torch.float32), dev)
    n = live_count(n_live, rows, dev)
    (tb, ta), (hb, ha), (pb, pa) = (_scalar(k, v, dev) for k, v in (
        ("tok_base", tok_base), ("hid_base", hid_base), ("pos_base", pos_base)))
    launch = (tokens_src, tb if tb is not None else n, hid_src, hb if hb is not None else n,
              pb if pb is not None else n, n, embed, enorm, hnorm)
    consts = dict(TOK_PTR=tb is not None, HID_PTR=hb is not None, POS_PTR=pb is not None)
    return EntryArgs(V, H, n, (launch, (ta, ha, pa, tok_max, S, V), consts))


@twin(_twins.draft_entry_ref)
def draft_entry(
    tokens_src: torch.Tensor,  # [P] int64 token ids by slot
    tok_base,  # int | [1] int32/int64: slot of row 0's token
    tok_max: int,  # last slot a row may read (the dump slot at depth 0), 0 ≤ tok_max < P
    hid_src: torch.Tensor,  # [S, H] bf16
    hid_base,  # int | [1] int32/int64: hid_src row of row 0 (clamped to [0, S − 1] per row)
    pos_base,  # int | [1] int32/int64: position of row 0
    n_live: torch.Tensor,  # [1] int32 live rows (rows ≥ R are ignored)
    embed: torch.Tensor,  # [V, H] bf16
    enorm: torch.Tensor,  # [H]
    hnorm: torch.Tensor,  # [H]
    eps: float,
    eh_out: torch.Tensor,  # [R, 2H] bf16, unit column stride: embedding half first
    pos_out: torch.Tensor,  # [R] int32
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (eh_out, pos_out): live rows of eh_out and every row of pos_out written.
    pdl: programmatic dependent launch (kernels/launch.py)."""
    check_tensor("draft_entry: eh_out", eh_out, dims=2, dtypes=(torch.bfloat16,))
    R = eh_out.shape[0]
    if R < 1:
        raise ValueError("draft_entry: eh_out has no rows")
    a = entry_args(tokens_src, tok_base, tok_max, hid_src, hid_base, pos_base, n_live, embed,
                   enorm, hnorm, R)
    dev, H = embed.device, a.H
    _unit_cols("eh_out", eh_out, (R, 2 * H), (torch.bfloat16,), dev)
    _unit_cols("pos_out", pos_out, (R,), (torch.int32,), dev)
    ptrs, ints, consts = a.launch
    _draft_entry_kernel[(R,)](
        *ptrs, eh_out, pos_out, *ints,
        tokens_src.stride(0), hid_src.stride(0), embed.stride(0), eh_out.stride(0), float(eps),
        HIDDEN=H, BLOCK_H=triton.next_power_of_2(H), **consts, num_warps=4,
        **launch_opts(pdl, **_COMPILE),
    )
    return eh_out, pos_out
