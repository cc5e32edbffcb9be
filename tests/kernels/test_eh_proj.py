"""kernels/eh_proj.py: a later draft depth's entry built inside the eh_proj GEMM.

Oracle: the two launches it replaces on the same inputs and launch configuration —
kernels.draft_entry (itself checked against plain-Python geometry and the twin in
test_draft_entry.py) then kernels.linear.linear_bf16_f32 — bit for bit on live rows; positions
exact; output rows ≥ n untouched. Inputs are test_draft_entry's cases: clamps at both ends,
out-of-range ids, 0 live rows, strided sources, host-int and device bases, everything a live row
must not read NaN. H = 200 makes column blocks of 128 straddle the embedding/hidden boundary.

Dimension letters: R rows, n live rows, H hidden, N output channels, S splits.
"""

from __future__ import annotations

import pytest
import torch

from kernels.draft_entry import draft_entry
from kernels.eh_proj import eh_proj
from kernels.linear import LinearLaunch, linear_bf16_f32
from tests.kernels.sm90 import fusion_counts
from tests.kernels.test_draft_entry import CASES, DEV, EPS, NAN, H, R, _bases, _inputs
from tests.kernels.test_draft_entry import _good_args as entry_good_args

CONFIGS = {  # name → (N, config): S > 1 through partials, S = 1 straight to the output
    "default": (H, None),
    "s1": (48, LinearLaunch(16, 1)),
    "s2_wide": (H, LinearLaunch(64, 2)),
    "s4_k64": (40, LinearLaunch(32, 4, block_k=64)),
}


def _weight(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2 * H, generator=g) / 8).bfloat16()


def _pair(c, n_out, cfg, out_dtype=torch.bfloat16, swap_fused_norms=False, seed=3):
    """(fused out, fused pos, composed out, composed pos), all on DEV, outputs poisoned first;
    swap_fused_norms: the fused call gets enorm and hnorm exchanged (a broken fused kernel)."""
    tokens, hid, embed, enorm, hnorm = (t.to(DEV) for t in _inputs(c, seed))
    w = _weight(n_out, seed + 1).to(DEV)
    n_live = torch.tensor([c.n], dtype=torch.int32, device=DEV)
    tb, hb, pb = _bases(c, DEV)
    src = (tokens, tb, c.tok_max, hid, hb, pb, n_live, embed, enorm, hnorm, EPS)
    out = torch.full((R, n_out), NAN, dtype=out_dtype, device=DEV)
    pos = torch.full((R,), 12345, dtype=torch.int32, device=DEV)
    fused_src = src[:8] + (hnorm, enorm) + src[10:] if swap_fused_norms else src
    eh_proj(*fused_src, w, pos, out_dtype=out_dtype, out=out, config=cfg)
    eh = torch.full((R, 2 * H), NAN, dtype=torch.bfloat16, device=DEV)
    want_pos = torch.full((R,), 12345, dtype=torch.int32, device=DEV)
    draft_entry(*src, eh, want_pos)
    want = torch.full((R, n_out), NAN, dtype=out_dtype, device=DEV)
    linear_bf16_f32(eh, w, n_live, out_dtype=out_dtype, out=want, config=cfg)
    return out.cpu(), pos.cpu(), want.cpu(), want_pos.cpu()


@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
@pytest.mark.slow
def test_fused_equals_entry_then_linear(c, cfg_name):
    n_out, cfg = CONFIGS[cfg_name]
    got, pos, want, want_pos = _pair(c, n_out, cfg)
    n = max(0, min(c.n, R))
    assert torch.equal(pos, want_pos)
    assert torch.equal(got[:n], want[:n]), f"{c.name}/{cfg_name}: fused differs from composed"
    assert torch.isfinite(got[:n]).all(), "a live row read a NaN source"
    assert torch.isnan(got[n:].float()).all(), "a row ≥ n was written"


def test_fp32_output():
    got, _, want, _ = _pair(CASES[1], H, LinearLaunch(64, 2), out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got[:2], want[:2])


def test_swapped_norm_weights_change_the_result():
    """The comparison sees which norm weight scales which half."""
    c = CASES[1]
    got, _, want, _ = _pair(c, H, None, swap_fused_norms=True)
    assert not torch.equal(got[:2], want[:2])


def _good_args():
    a = entry_good_args()  # the entry launch's sources; eh_proj writes x instead of eh
    del a["eh_out"]
    return a | dict(weight=torch.zeros(H, 2 * H, dtype=torch.bfloat16, device=DEV))


BAD = [  # (argument, bad value, words the error must contain)
    ("weight", lambda a: torch.zeros(H, H, dtype=torch.bfloat16, device=DEV), "2H"),
    ("weight", lambda a: torch.zeros(H, 2 * H, device=DEV), "weight"),
    ("pos_out", lambda a: torch.empty(17, dtype=torch.int32, device=DEV), "1..16"),
    ("pos_out", lambda a: torch.empty(R, dtype=torch.int64, device=DEV), "pos_out"),
    ("tok_max", lambda a: 8, "tok_max"),
    ("hid_src", lambda a: a["hid_src"].float(), "hid_src"),
    ("config", lambda a: LinearLaunch(64, 2, num_warps=8), "num_warps"),
    ("out_dtype", lambda a: torch.float16, "out_dtype"),
]


@pytest.mark.parametrize("arg,make,words", BAD, ids=[f"{b[0]}{i}" for i, b in enumerate(BAD)])
def test_bad_inputs_are_named(arg, make, words):
    args = _good_args()
    eh_proj(**args)  # the good call passes
    args[arg] = make(args)
    with pytest.raises(ValueError, match=words):
        eh_proj(**args)


@pytest.mark.gpu
def test_compiled_at_the_iquest_rank_shape():
    """H = 3072, eh_proj [3072, 6144] with its pinned launch (48 tiles × 3 splits): the compiled
    fused kernel equals the compiled entry launch + linear bit for bit (the sum of squares must
    reduce in the entry launch's order)."""
    h, n = 3072, 3072
    g = torch.Generator().manual_seed(5)
    embed = torch.randn(64, h, generator=g).bfloat16().cuda()
    hid = (torch.randn(8, h, generator=g) * 3).bfloat16().cuda()
    enorm, hnorm = ((1 + 0.3 * torch.randn(h, generator=g)).bfloat16().cuda() for _ in range(2))
    w = (torch.randn(n, 2 * h, generator=g) / 64).bfloat16().cuda()
    tokens = torch.randint(0, 64, (7,), generator=g).cuda()
    i32 = dict(dtype=torch.int32, device="cuda")
    for live in (1, 2, 8):
        n_live = torch.tensor([live], **i32)
        src = (tokens, torch.tensor([1], **i32), 6, hid, torch.tensor([0], **i32),
               torch.tensor([40], **i32), n_live, embed, enorm, hnorm, EPS)
        got, pos = eh_proj(*src, w, torch.empty(8, **i32))
        eh = torch.empty(8, 2 * h, dtype=torch.bfloat16, device="cuda")
        _, want_pos = draft_entry(*src, eh, torch.empty(8, **i32))
        want = linear_bf16_f32(eh, w, n_live, out_dtype=torch.bfloat16)
        assert torch.equal(pos, want_pos)
        assert torch.equal(got[:live], want[:live]), f"{live} live rows: fused != composed"


SM90_EH_PROJ = dict(
    module="eh_proj", kernel="_eh_proj_kernel",
    sig=dict(tok_ptr="*i64", tok_base_ptr="*i32", hid_ptr="*bf16", hid_base_ptr="*i64",
             pos_base_ptr="*i32", n_live_ptr="*i32", embed_ptr="*bf16", enorm_ptr="*bf16",
             hnorm_ptr="*bf16", w_ptr="*bf16", out_ptr="*fp32", pos_ptr="*i32", eps="fp32"),
    const=dict(HIDDEN=3072, BLOCK_H=4096, KB=16, BLOCK_N=64, BLOCK_K=128, BLOCK_R=16,
               OUT_BF16=False, INTERPRET=False, TOK_PTR=True, HID_PTR=True, POS_PTR=True,
               PDL=False),
    patterns=(r"fma\.rn\.f32", r"div\.rn\.f32", r"sqrt\.rn\.f32", r"sqrt\.approx", r"rsqrt",
              r"mma\.sync|wgmma"))


@pytest.mark.slow
def test_eh_proj_compiles_for_sm90_with_the_entry_rounding():
    """The IQuest rank launch (48 tiles × 3 splits of 16 blocks) builds for sm_90 as launched
    (enable_fp_fusion=False): the row norms with IEEE div.rn / sqrt.rn, no approximate sqrt, no
    FMA contraction, and the dot on tensor cores; with fusion on FMAs appear (the count can
    fail)."""
    off, on = fusion_counts(**SM90_EH_PROJ)
    got = {"False": off, "True": on}
    assert off["fma\\.rn\\.f32"] == 0 and on["fma\\.rn\\.f32"] > 0, got
    assert off["div\\.rn\\.f32"] >= 4 and off["sqrt\\.rn\\.f32"] >= 2, got
    assert off["sqrt\\.approx"] == off["rsqrt"] == 0, got
    assert off["mma\\.sync|wgmma"] > 0, got
