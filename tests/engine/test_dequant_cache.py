"""The twins' dequantization memo (iquestrt/ops_twins.py DequantCache): the values of the
uncached ops.dequant_block bit for bit (held in FP64, which FP32 converts to exactly), one
dequantization per weight version, and twins that give the same bits with and without it."""

import torch

from iquestrt.ops_twins import DequantCache
from reference import ops
from reference.twins import linear as t_linear
from reference.twins import moe as t_moe


def _fp8(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*shape, generator=g) * 3).to(torch.float8_e4m3fn)  # E4M3 [..., N, K]
    lead, (n, k) = shape[:-2], shape[-2:]
    s = torch.rand(*lead, -(-n // 128), -(-k // 128), generator=g) / 100 + 1e-3  # FP32 scales
    return w, s


def test_cached_values_are_the_uncached_ones_and_follow_in_place_changes():
    w, s = _fp8(200, 300, seed=0)  # partial 128-blocks both ways
    cache = DequantCache()
    got = cache(w, s)
    want = ops.dequant_block(w, s)
    assert want.dtype == torch.float32 and got.dtype == torch.float64
    assert torch.equal(got.float(), want) and torch.equal(got, want.double())
    assert cache(w, s) is got and len(cache.table) == 1  # memoized
    w[3, 7] = w[3, 7].float() * 2 + 1  # in place: a new version, a new entry
    again = cache(w, s)
    assert again is not got and len(cache.table) == 2
    assert torch.equal(again.float(), ops.dequant_block(w, s))
    assert again[3, 7] != got[3, 7]


def test_twins_give_the_same_bits_with_the_memo():
    cache = DequantCache()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 300, generator=g).to(torch.bfloat16)  # [R, K]
    w, s = _fp8(200, 300, seed=2)
    for out_dtype in (torch.bfloat16, torch.float32):
        plain = t_linear.linear_fp8_ref(x, w, s, out_dtype=out_dtype)
        memo = t_linear.linear_fp8_ref(x, w, s, out_dtype=out_dtype, dequant=cache)
        assert memo.dtype == out_dtype and torch.equal(memo, plain)
    fc, fcs = _fp8(4, 2 * 160, 300, seed=3)  # [E, 2I, H]
    proj, ps = _fp8(4, 300, 160, seed=4)  # [E, H, I]
    ids = torch.tensor([[0, 2], [3, 0], [1, 1]])  # [R, K]: a shared expert, a repeated one
    weights = torch.rand(3, 2, generator=g)
    plain = t_moe.moe_fp8_ref(x, weights, ids, fc, fcs, proj, ps)
    memo = t_moe.moe_fp8_ref(x, weights, ids, fc, fcs, proj, ps, dequant=cache)
    assert torch.equal(memo, plain) and memo.dtype == torch.bfloat16
