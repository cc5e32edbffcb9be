"""reference/ops.py against the independent float64/mpmath oracles in tests/helpers/oracles.py.

Every comparison goes through qualification.tolerances.check; every sensitivity claim is shown
with a deliberately broken variant that must fail the same check.
"""

import pytest
import torch

from qualification.tolerances import check
from reference import ops
from tests.helpers import oracles as O

BF16 = torch.bfloat16


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fails(actual, expected, op, dtype) -> None:
    with pytest.raises(AssertionError):
        check(actual, expected, op, dtype)


# --- rms_norm ------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [32, 128, 3072])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_rms_norm_fp32(dim, scale):
    g = gen(dim)
    x = torch.randn(9, dim, generator=g) * scale
    w = 1 + 0.3 * torch.randn(dim, generator=g)
    y = ops.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32
    print(check(y, O.rms_norm64(x, w, 1e-6).float(), "ref.rms_norm", "fp32"))


def test_rms_norm_bf16_and_out_dtype():
    g = gen(1)
    x = torch.randn(7, 128, generator=g).to(BF16)
    w = (1 + 0.3 * torch.randn(128, generator=g)).to(BF16)
    ref = O.rms_norm64(x, w, 1e-6)
    y = ops.rms_norm(x, w, 1e-6)
    assert y.dtype == BF16
    print(check(y, ref.to(BF16), "ref.rms_norm", "bf16"))
    y32 = ops.rms_norm(x, w, 1e-6, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    check(y32, ref.float(), "ref.rms_norm", "fp32")
    fails(ops.rms_norm(x, 1 + w, 1e-6), ref.to(BF16), "ref.rms_norm", "bf16")  # 1 + weight


def test_rms_norm_broken_variants_fail():
    g = gen(2)
    x = torch.randn(5, 128, generator=g) * 1e-3  # rms ≈ sqrt(eps): eps placement matters
    w = 1 + 0.3 * torch.randn(128, generator=g)
    ref = O.rms_norm64(x, w, 1e-6).float()
    check(ops.rms_norm(x, w, 1e-6), ref, "ref.rms_norm", "fp32")
    eps_outside = x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6) * w
    fails(eps_outside, ref, "ref.rms_norm", "fp32")
    fails(ops.rms_norm(x, 1 + w, 1e-6), ref, "ref.rms_norm", "fp32")


# --- RoPE ----------------------------------------------------------------------------------

POSITIONS = [0, 1, 7, 4095, 4096, 131071, 524287]


def rope_fp32_angles(x, positions, rotary_dim, theta):
    """Broken: angles formed in FP32 (pos · inv_freq loses ~pos·2^-24 rad)."""
    half = rotary_dim // 2
    inv = (1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)).float()
    ang = positions.float()[:, None] * inv[None]
    c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rotary_dim:]], -1)


def rope_gptj(x, positions, rotary_dim, theta):
    """Broken: interleaved pairs (2i, 2i+1) instead of (i, i + rotary_dim/2)."""
    perm = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                      torch.arange(rotary_dim, x.shape[-1])])
    return ops.rope(x[..., perm], positions, rotary_dim, theta)[..., torch.argsort(perm)]


@pytest.mark.parametrize("theta", [1e6, 1e4])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 32), (32, 8)])
def test_rope_vs_mpmath(theta, head_dim, rotary_dim):
    x = torch.randn(len(POSITIONS), 3, head_dim, generator=gen(head_dim))  # [R, heads, D]
    pos = torch.tensor(POSITIONS)
    ref = O.rope64(x, POSITIONS, rotary_dim, theta)
    y = ops.rope(x, pos, rotary_dim, theta)
    assert y.dtype == torch.float32
    print(check(y, ref.float(), "ref.rope", "fp32"))
    check(y[..., rotary_dim:], x[..., rotary_dim:], "ref.rope_passthrough", "any")
    # rotation preserves the norm of the rotated part of every head
    norm = lambda t: t[..., :rotary_dim].double().norm(dim=-1)  # noqa: E731
    check(norm(y), norm(x), "ref.rope", "fp32")
    fails(rope_fp32_angles(x, pos, rotary_dim, theta), ref.float(), "ref.rope", "fp32")
    fails(rope_gptj(x, pos, rotary_dim, theta), ref.float(), "ref.rope", "fp32")
    # inv_freq = theta^(-2i/head_dim) is the same as theta' = theta^(rotary_dim/head_dim)
    fails(ops.rope(x, pos, rotary_dim, theta ** (rotary_dim / head_dim)), ref.float(),
          "ref.rope", "fp32")


def test_rope_bf16():
    x = torch.randn(len(POSITIONS), 4, 128, generator=gen(3)).to(BF16)
    pos = torch.tensor(POSITIONS)
    ref = O.rope64(x, POSITIONS, 32, 1e6)
    y = ops.rope(x, pos, 32, 1e6)
    assert y.dtype == BF16
    print(check(y, ref.to(BF16), "ref.rope", "bf16"))
    check(y[..., 32:], x[..., 32:], "ref.rope_passthrough", "any")
    fails(rope_gptj(x, pos, 32, 1e6), ref.to(BF16), "ref.rope", "bf16")


# --- attention -----------------------------------------------------------------------------


def attn_case(seed, r=5, n_keys=40, hq=6, hkv=2, d=32, sink_rms=2.0):
    g = gen(seed)
    q = torch.randn(r, hq, d, generator=g)
    k = torch.randn(n_keys, hkv, d, generator=g)
    v = torch.randn(n_keys, hkv, d, generator=g)
    sink = torch.randn(hkv, d, generator=g) * sink_rms
    q_pos = torch.arange(n_keys - r, n_keys)  # verify-like rows: the last r positions
    return q, k, v, q_pos, torch.arange(n_keys), sink, d**-0.5


@pytest.mark.parametrize("window", [None, 16])
def test_attention_sink_equals_extra_key(window):
    q, k, v, qp, kp, sink, sc = attn_case(4)
    args = (q, k, v, qp.tolist(), kp.tolist(), window)
    ref = O.attention64(*args, sink, sc).float()
    y = ops.attention(q, k, v, qp, kp, window, sink, sc)
    print(check(y, ref, "ref.attention", "fp32"))
    # the sink matters: its mass is neither negligible nor everything, and dropping it is gross
    mass = O.attention_probs64(q, k, qp.tolist(), kp.tolist(), window, sink, sc)[..., -1]
    assert 0.05 < mass.mean() < 0.95, mass.mean()
    no_sink = O.attention64(*args, None, sc)
    assert (no_sink - ref.double()).abs().max() > 0.05 * ref.abs().max()
    fails(ops.attention(q, k, v, qp, kp, window, None, sc), ref, "ref.attention", "fp32")
    fails(ops.attention(q, k, v, qp, kp, window, sink.roll(1, 0), sc), ref, "ref.attention",
          "fp32")  # sink key of group g+1


def test_attention_gqa_mapping():
    q, k, v, qp, kp, sink, sc = attn_case(5, hq=6, hkv=2)  # heads 0-2 → group 0, 3-5 → group 1
    args = (q, k, v, qp.tolist(), kp.tolist(), None, sink, sc)
    y = ops.attention(q, k, v, qp, kp, None, sink, sc)
    check(y, O.attention64(*args).float(), "ref.attention", "fp32")
    tiled = O.attention64(*args, group_of=lambda h, nq, nkv: h % nkv).float()
    fails(y, tiled, "ref.attention", "fp32")


def test_attention_bf16():
    q, k, v, qp, kp, sink, sc = attn_case(6)
    q, k, v, sink = q.to(BF16), k.to(BF16), v.to(BF16), sink.to(BF16)
    ref = O.attention64(q, k, v, qp.tolist(), kp.tolist(), 16, sink, sc)
    y = ops.attention(q, k, v, qp, kp, 16, sink, sc)
    assert y.dtype == BF16
    print(check(y, ref.to(BF16), "ref.attention", "bf16"))
    fails(ops.attention(q, k, v, qp, kp, 16, None, sc), ref.to(BF16), "ref.attention", "bf16")


@pytest.mark.parametrize("window", [None, 1, 4, 16])
def test_visible_mask(window):
    m = ops.visible(torch.arange(41), torch.arange(41), window)
    want = torch.tensor([[O.sees(t, j, window) for j in range(41)] for t in range(41)])
    assert torch.equal(m, want)


@pytest.mark.parametrize("window,t", [(2, 2), (5, 5), (5, 30), (16, 16), (16, 40)])
def test_window_edges_with_sentinels(window, t):
    """One query at t. Keys 0 … t+2: the inside edge t−W+1 has logit ≈ 20 and value +5, the
    outside edge t−W has logit ≈ 40 and value −5, the future key t+1 has logit ≈ 60 and value
    +20. Only the exact window yields ≈ +5; W+1 yields ≈ −5, W−1 the mean of plain values."""
    g = gen(t * 100 + window)
    hq, hkv, d = 4, 2, 16
    u = torch.zeros(d)
    u[0] = 1.0
    q = 0.3 * torch.randn(1, hq, d, generator=g) + 4.0 * u  # every head has ⟨q, u⟩ ≈ 4
    n = t + 3
    k = 0.3 * torch.randn(n, hkv, d, generator=g)
    k[:, :, 0] = 0.0
    v = torch.randn(n, hkv, d, generator=g)
    sc = d**-0.5
    sentinels = ((t - window + 1, 20.0, 5.0), (t - window, 40.0, -5.0), (t + 1, 60.0, 20.0))
    for pos, logit, val in sentinels:
        k[pos] = u * logit / (4.0 * sc)
        v[pos] = val
    sink = 0.3 * torch.randn(hkv, d, generator=g)
    qp, kp = torch.tensor([t]), torch.arange(n)
    ref = O.attention64(q, k, v, [t], kp.tolist(), window, sink, sc).float()
    assert (ref - 5.0).abs().max() < 0.1  # the sentinel construction works as designed
    check(ops.attention(q, k, v, qp, kp, window, sink, sc), ref, "ref.attention", "fp32")
    for broken in (window + 1, window - 1):
        fails(ops.attention(q, k, v, qp, kp, broken, sink, sc), ref, "ref.attention", "fp32")


# --- router --------------------------------------------------------------------------------


def test_route_random():
    g = gen(7)
    x = torch.randn(33, 128, generator=g)
    rw = torch.randn(16, 128, generator=g) * 2 / 128**0.5
    w, ids = ops.route(x, rw, 4)
    w64, ids64 = O.route64(x, rw, 4)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    check(ids, ids64, "ref.route_ids", "int64")
    print(check(w, w64.float(), "ref.route", "fp32"))
    probs = torch.softmax(x.double() @ rw.double().t(), -1)
    fails(w, probs.gather(1, ids64).float(), "ref.route", "fp32")  # not renormalized


def test_route_exact_ties():
    """Grid-valued x and router (all logits exact in FP32 and FP64). Experts 0 and 14 tie at
    logit 3; experts 2, 5, 11, 13 tie at logit 1; all others are below −2, so
    top-4 must take 0, 14, then 2, 5 — in every row."""
    g = gen(8)
    e, h = 16, 8
    x = torch.randint(-1, 2, (12, h), generator=g).float() / 2
    x[:, 0] = 1.0
    rw = torch.randint(-1, 2, (e, h), generator=g).float() / 4
    rw[:, 0] = -3.0
    rw[14] = rw[0] = torch.tensor([3.0] + [0.0] * (h - 1))
    for ex in (2, 5, 11, 13):
        rw[ex] = torch.tensor([1.0] + [0.0] * (h - 1))
    w, ids = ops.route(x, rw, 4)
    w64, ids64 = O.route64(x, rw, 4)
    assert torch.equal(ids64, torch.tensor([[0, 14, 2, 5]] * 12))  # the construction holds
    check(ids, ids64, "ref.route_ids", "int64")
    check(w, w64.float(), "ref.route", "fp32")
    _, ids_rev = ops.route(x, rw.flip(0), 4)  # the same router with ties broken high-first
    fails(e - 1 - ids_rev, ids64, "ref.route_ids", "int64")


# --- swiglu and moe ------------------------------------------------------------------------


def ffn_weights(g, h, inter, dtype):
    gw = torch.randn(inter, h, generator=g) / h**0.5
    uw = torch.randn(inter, h, generator=g) / h**0.5
    dw = torch.randn(h, inter, generator=g) / inter**0.5
    return gw.to(dtype), uw.to(dtype), dw.to(dtype)


@pytest.mark.parametrize("dtype,name", [(torch.float32, "fp32"), (BF16, "bf16")])
def test_swiglu(dtype, name):
    g = gen(9)
    x = torch.randn(11, 128, generator=g).to(dtype)
    gw, uw, dw = ffn_weights(g, 128, 256, dtype)
    ref = O.swiglu64(x, gw, uw, dw).to(dtype)
    y = ops.swiglu(x, gw, uw, dw)
    assert y.dtype == dtype
    print(check(y, ref, "ref.swiglu", name))
    fails(ops.swiglu(x, uw, gw, dw), ref, "ref.swiglu", name)  # gate and up swapped


@pytest.mark.parametrize("dtype,name", [(torch.float32, "fp32"), (BF16, "bf16")])
def test_moe(dtype, name):
    g = gen(10)
    r, h, inter, n_exp = 9, 48, 24, 6
    x = torch.randn(r, h, generator=g).to(dtype)
    fc = (torch.randn(n_exp, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    proj = (torch.randn(n_exp, h, inter, generator=g) / inter**0.5).to(dtype)
    fc[4] = float("nan")  # expert 4 gets zero rows: its weights must never be read
    proj[4] = float("nan")
    ids = torch.tensor(
        [[1, 0, 2], [1, 3, 5], [2, 1, 0], [5, 1, 3], [1, 2, 0],
         [0, 1, 5], [3, 5, 1], [1, 0, 3], [2, 5, 1]]
    )  # expert 1 in every row, in every slot position somewhere
    w = torch.rand(r, 3, generator=g) + 0.1
    w = w / w.sum(-1, keepdim=True)
    ref = O.moe64(x, w, ids, fc, proj).to(dtype)
    y = ops.moe(x, w, ids, fc, proj)
    assert y.dtype == dtype and torch.isfinite(y).all()
    print(check(y, ref, "ref.moe", name))
    fails(ops.moe(x, w * (ids != 2), ids, fc, proj), ref, "ref.moe", name)  # expert 2 dropped
    fails(ops.moe(x, w, ids.roll(1, 0), fc, proj), ref, "ref.moe", name)  # rows misassigned


# --- block FP8 -----------------------------------------------------------------------------

WEIGHT_SHAPES = [(19, 99), (130, 257), (3, 130, 200)]


def pow2_scales(shape, g, lo=-10, hi=5):
    return torch.exp2(torch.randint(lo, hi, shape, generator=g).float())


def snapped_weight(shape, g):
    """E4M3 codes × a power of two per 128×128 block, one ±448 code planted per block."""
    codes = O.e4m3_decode(O.random_e4m3_codes(shape, g))
    *lead, n, k = shape
    grid = (*lead, O.ceil_div(n), O.ceil_div(k))
    for bi in range(grid[-2]):
        for bj in range(grid[-1]):
            codes[..., bi * 128, bj * 128] = 448.0
    s = pow2_scales(grid, g)
    return (codes * O.dequant_block64(torch.ones(shape).to(torch.float8_e4m3fn), s)).float(), s


def block_max_codes(q, rows_per_block=128):
    return O.block_amax64(O.e4m3_decode(q), rows_per_block)


@pytest.mark.parametrize("shape", WEIGHT_SHAPES)
def test_dequant_block_exact(shape):
    g = gen(sum(shape))
    w = O.random_e4m3_codes(shape, g)
    *lead, n, k = shape
    s = torch.exp(torch.randn(*lead, O.ceil_div(n), O.ceil_div(k), generator=g) * 3)  # not 2^k
    ref = O.dequant_block64(w, s).float()
    check(ops.dequant_block(w, s), ref, "ref.dequant_block", "fp32")
    if s.shape[-1] > 1:
        fails(ops.dequant_block(w, s.roll(1, -1)), ref, "ref.dequant_block", "fp32")
    if lead:  # one expert's scale block shifted onto the next expert
        fails(ops.dequant_block(w, s.roll(1, 0)), ref, "ref.dequant_block", "fp32")


def test_dequant_rejects_wrong_scale_grid():
    w = torch.zeros(19, 300).to(torch.float8_e4m3fn)
    for bad in ((3, 1), (2, 3), (1, 2)):
        with pytest.raises(ValueError, match=r"scale_inv shape .*expected \(1, 3\)"):
            ops.dequant_block(w, torch.ones(bad))
    with pytest.raises(ValueError, match=r"dequant_act: scale shape"):
        ops.dequant_act(w, torch.ones(19, 2))


@pytest.mark.parametrize("shape", WEIGHT_SHAPES)
def test_quantize_block_round_trip_lossless(shape):
    w, s_true = snapped_weight(shape, gen(sum(shape) + 1))
    for p2 in (False, True):
        q, s = ops.quantize_block(w, power_of_two=p2)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        check(s, s_true, "ref.quantize_block", "e4m3")  # 448 planted: amax/448 is the 2^k
        check(ops.dequant_block(q, s), w, "ref.quantize_block", "e4m3")
        check(O.dequant_block64(q, s).float(), w, "ref.quantize_block", "e4m3")


@pytest.mark.parametrize("shape", WEIGHT_SHAPES)
def test_quantize_block_generic(shape):
    """Off-grid data with block magnitudes spread over 2^±6: scales, codes and the ±448 peak."""
    g = gen(sum(shape) + 2)
    *lead, n, k = shape
    grid = (*lead, O.ceil_div(n), O.ceil_div(k))
    mag = torch.exp2(torch.randint(-6, 7, grid, generator=g).double())
    w = (torch.randn(shape, generator=g, dtype=torch.float64) * O.dequant_block64(
        torch.ones(shape).to(torch.float8_e4m3fn), mag)).float()
    if grid[-1] > 1:
        w[..., :128, :128] = 0.0  # one all-zero block (per expert): scale 1, zero codes
    q, s = ops.quantize_block(w)
    amax = O.block_amax64(w)
    s_want = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float()
    check(s, s_want, "ref.quantize_block", "e4m3")
    peaks = block_max_codes(q)
    check(peaks, torch.where(amax > 0, 448.0, 0.0).double(), "ref.quantize_block", "e4m3")
    ratio = w.double() / O.dequant_block64(torch.ones(shape).to(torch.float8_e4m3fn), s)
    want, near_tie = O.nearest_e4m3(ratio.clamp(-448, 448))
    got = O.e4m3_decode(q)
    assert near_tie.float().mean() < 1e-3
    check(got[~near_tie], want[~near_tie], "ref.quantize_block", "e4m3")
    q2, _ = ops.quantize_block(w, power_of_two=True)  # broken: forced 2^k on off-grid data
    fails(block_max_codes(q2), torch.where(amax > 0, 448.0, 0.0).double(),
          "ref.quantize_block", "e4m3")


@pytest.mark.parametrize("shape", [(5, 99), (7, 300), (3, 257)])
def test_quantize_act(shape):
    g = gen(sum(shape))
    r, k = shape
    nc = O.ceil_div(k)
    x = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(-6, 7, (r, nc), generator=g).float()).repeat_interleave(128, -1)[:, :k]
    x[0, :128] = 0.0
    q, s = ops.quantize_act(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (r, nc)
    amax = O.block_amax64(x, rows_per_block=1)  # [R, nc]
    check(s, torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float(),
          "ref.quantize_act", "e4m3")
    want_peak = torch.where(amax > 0, 448.0, 0.0).double()
    check(block_max_codes(q, 1), want_peak, "ref.quantize_act", "e4m3")
    ref = (O.e4m3_decode(q) * s.double().repeat_interleave(128, -1)[:, :k]).float()
    check(ops.dequant_act(q, s), ref, "ref.dequant_act", "fp32")
    if nc > 1:
        # broken: one scale per row from the whole row's amax
        row_s = (x.abs().amax(-1, keepdim=True) / 448.0).clamp(min=2.0**-126)
        q_row = (x / row_s).to(torch.float8_e4m3fn)
        fails(block_max_codes(q_row, 1), want_peak, "ref.quantize_act", "e4m3")
        fails(ops.dequant_act(q, s.roll(1, -1)), ref, "ref.dequant_act", "fp32")


def test_quantize_act_round_trip_lossless():
    g = gen(11)
    r, k = 6, 300
    codes = O.e4m3_decode(O.random_e4m3_codes((r, k), g))
    codes[:, ::128] = -448.0  # every 128-column group peaks at 448
    s = pow2_scales((r, O.ceil_div(k)), g)
    x = (codes * s.double().repeat_interleave(128, -1)[:, :k]).float()
    q, s_got = ops.quantize_act(x)
    check(s_got, s, "ref.quantize_act", "e4m3")
    check(ops.dequant_act(q, s_got), x, "ref.quantize_act", "e4m3")
