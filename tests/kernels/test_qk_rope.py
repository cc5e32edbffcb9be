"""kernels/qk_rope.py against its twin (reference/twins/qk_rope.py qk_rope_ref): bit-exact for bf16
qkv and for FP32 split-K partials, and close to the literal reference/model.py `_attn` path
(ops.rms_norm + ops.rope) — rows "kernels.qk_rope*" of qualification/tolerances.py. With a cache,
the fused KV write equals qk_rope then kernels.kv_cache.write_kv (and the twin's write_ref) bit
for bit.

Inputs: Gaussian qkv with per-head magnitudes 2^±8 (bf16, or FP32 partials), norm weights in
[0.5, 1.5), positions up to the table's end (524287 for the per-rank case). Outputs are poisoned
with payload NaNs; padding rows of qkv hold NaN and their positions are out of range.

Dimension letters: R buffer rows, n live rows, S partials, Hq / Hkv heads, D head dim, P table
positions, rot rotary dims.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from iquestrt.capture import graph_capture
from kernels.kv_cache import KVLayout, LayerKV, write_kv
from kernels.linear import LinearLaunch, linear_fp8, linear_fp8_partials
from kernels.qk_rope import QkRopeLaunch, RopeTable, qk_rope, rope_table
from qualification.tolerances import check, tolerance
from reference import ops
from reference.twins.qk_rope import head_rms_norm_ref, qk_rope_ref
from tests.kernels.sm90 import fusion_counts

EPS = 1e-6
POISON = 0x7FE5  # a bf16 quiet NaN with a payload no arithmetic produces


@dataclass(frozen=True)
class Case:
    name: str
    hq: int
    hkv: int
    d: int
    rot: int
    theta: float
    table_positions: int
    rows: int
    n_live: int
    splits: int = 1  # 1: bf16 qkv; > 1: FP32 partials [S, R, W]
    norm: bool = True
    w_dtype: torch.dtype = torch.bfloat16

    @property
    def width(self) -> int:
        return (self.hq + 2 * self.hkv) * self.d


CASES = (
    Case("tiny-sliding-6of8", 12, 2, 32, 8, 1e4, 4096, 8, 6),
    Case("tiny-full-partials3", 12, 2, 32, 8, 1e6, 4096, 8, 8, splits=3),
    Case("odd-d24-rot6-fp32w", 3, 1, 24, 6, 1e4, 600, 3, 3, splits=2, w_dtype=torch.float32),
    Case("rot-all-dims-no-norm", 2, 1, 16, 16, 1e4, 64, 4, 1, norm=False),
    Case("rank-1of8-P524288", 6, 1, 128, 32, 1e6, 524288, 8, 1, splits=8),
    Case("rank-5of8", 6, 1, 128, 32, 1e4, 8192, 8, 5),
)


@dataclass(frozen=True)
class Inputs:
    qkv: torch.Tensor  # [R, W] bf16 or [S, R, W] fp32
    q_w: torch.Tensor | None  # [D]
    k_w: torch.Tensor | None
    pos: torch.Tensor  # [R] int32
    n: torch.Tensor  # [1] int32


def make_inputs(case: Case, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    r, heads, d, n = case.rows, case.hq + 2 * case.hkv, case.d, case.n_live
    mag = torch.exp2(torch.randint(-8, 9, (r, heads, 1), generator=gen).float())
    base = (torch.randn(r, heads, d, generator=gen) * mag).reshape(r, case.width)
    if case.splits == 1:
        qkv = base.clone()
        qkv[n:] = float("nan")
        qkv = qkv.bfloat16()
    else:  # partials that sum to about base
        qkv = torch.randn(case.splits, r, case.width, generator=gen) * base.abs()[None] / 2
        qkv[0] += base
        qkv[:, n:] = float("nan")
    ws = [(torch.rand(d, generator=gen) + 0.5).to(case.w_dtype) for _ in range(2)]
    last = case.table_positions - 1
    pos = torch.randint(0, case.table_positions, (r,), generator=gen)
    pos[: min(n, 2)] = torch.tensor([last, max(0, last - 4095)])[: min(n, 2)]  # the table's end
    pos[n:] = -7  # never read
    return Inputs(qkv, ws[0] if case.norm else None, ws[1] if case.norm else None,
                  pos.to(torch.int32), torch.tensor([n], dtype=torch.int32))


def poisoned(shape, device) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=torch.int16, device=device).view(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.int16)


def run_kernel(case: Case, inp: Inputs, table: RopeTable, device, **kw):
    r = case.rows
    outs = [poisoned((r, h, case.d), device) for h in (case.hq, case.hkv, case.hkv)]
    dev = [None if t is None else t.to(device) for t in (inp.qkv, inp.q_w, inp.k_w, inp.pos,
                                                           inp.n)]
    got = qk_rope(dev[0], dev[1], dev[2], dev[3], table, dev[4], num_q_heads=case.hq,
                  num_kv_heads=case.hkv, eps=EPS, q_out=outs[0], k_out=outs[1], v_out=outs[2],
                  **kw)
    for name, t in zip("qkv", got, strict=True):
        live = t.cpu()[: case.n_live]
        assert not torch.isnan(live).any(), f"{name}: live rows not fully written"
        assert (bits(t[case.n_live :]) == POISON).all(), f"{name}: padding rows were written"
    return tuple(t.cpu()[: case.n_live] for t in got)


def twin(case: Case, inp: Inputs, table: RopeTable):
    return qk_rope_ref(inp.qkv, inp.q_w, inp.k_w, inp.pos, table, inp.n, num_q_heads=case.hq,
                       num_kv_heads=case.hkv, eps=EPS)


def model_path(case: Case, inp: Inputs, theta: float | None = None):
    """reference/model.py `_attn` in BF16 mode, line for line, on the live rows."""
    n = case.n_live
    qkv = inp.qkv[:, :n].sum(0) if inp.qkv.dim() == 3 else inp.qkv[:n]
    qkv = qkv.bfloat16()
    d, qs, kvs = case.d, case.hq * case.d, case.hkv * case.d
    q = qkv[:, :qs].reshape(n, case.hq, d)
    k = qkv[:, qs : qs + kvs].reshape(n, case.hkv, d)
    v = qkv[:, qs + kvs :].reshape(n, case.hkv, d)
    if case.norm:
        q, k = ops.rms_norm(q, inp.q_w, EPS), ops.rms_norm(k, inp.k_w, EPS)
    pos = inp.pos[:n].long()
    theta = case.theta if theta is None else theta
    return ops.rope(q, pos, case.rot, theta), ops.rope(k, pos, case.rot, theta), v


def assert_bit_exact(got, want, what: str) -> None:
    for name, a, b in zip("qkv", got, want, strict=True):
        check(bits(a), bits(b), "kernels.qk_rope", "bf16")
        assert a.dtype == b.dtype == torch.bfloat16, f"{what} {name}: dtype"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.slow
def test_qk_rope_matches_twin_bit_exactly(case, device):
    inp = make_inputs(case, 60 + CASES.index(case))
    table = rope_table(case.table_positions, case.rot, case.theta, device)
    got = run_kernel(case, inp, table, device)
    assert_bit_exact(got, twin(case, inp, table), case.name)
    ref = model_path(case, inp)
    for name, a, b in zip("qk", got, ref, strict=False):
        m = check(a.float(), b.float(), "kernels.qk_rope.vs_reference", "bf16")
        print(f"\n  [{case.name}] {name} vs model._attn: {m}, "
              f"{int((bits(a) != bits(b)).sum())} of {a.numel()} differ")
    assert torch.equal(bits(got[2]), bits(ref[2])), "v is the projection's bf16 value"


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_rows_per_program_give_the_same_bits(rows, device):
    """QkRopeLaunch.rows: a program per row (the compiled default) and blocks of 2 or 4 rows
    (padding rows inside a block, a block past the live rows, one past R) give the twin's bits,
    as the default block of every row does (the test above, under the interpreter)."""
    for case in (CASES[0], CASES[2]):
        inp = make_inputs(case, 60 + CASES.index(case))
        table = rope_table(case.table_positions, case.rot, case.theta, device)
        got = run_kernel(case, inp, table, device, config=QkRopeLaunch(rows=rows))
        assert_bit_exact(got, twin(case, inp, table), f"{case.name}, {rows} rows a program")
    with pytest.raises(ValueError, match="QkRopeLaunch.rows: power of two"):
        QkRopeLaunch(rows=3)


@pytest.mark.parametrize("offset", [-1, 0])
@pytest.mark.slow
def test_a_shifted_table_rotates_row_p_at_p_plus_offset(offset, device):
    """The draft's table (draft_position_offset −1): row p holds the angle of p − 1. The kernel
    reads the table, the twin recomputes from (position + table.offset): bit-exact, and both
    equal an unshifted table at the shifted positions, and the model path there."""
    case = CASES[0]
    inp = make_inputs(case, 97)
    shifted = rope_table(case.table_positions, case.rot, case.theta, device, offset)
    assert shifted.offset == offset
    inp = dataclasses.replace(inp, pos=inp.pos.clamp(min=1))  # a draft row is never at 0
    got = run_kernel(case, inp, shifted, device)
    assert_bit_exact(got, twin(case, inp, shifted), f"offset {offset}")
    plain = rope_table(case.table_positions, case.rot, case.theta, device)
    moved = dataclasses.replace(inp, pos=inp.pos + offset)
    assert_bit_exact(got, run_kernel(case, moved, plain, device), f"offset {offset} vs moved")
    if offset:
        assert not all(torch.equal(bits(a), bits(b)) for a, b in
                       zip(got[:2], run_kernel(case, inp, plain, device)[:2], strict=True))


def test_twin_vs_model_path_sweep():
    """Pure torch: how often the FP64-sum norm of the twin and ops.rms_norm's FP32 mean give
    different bf16 q/k after RoPE (the vs_reference row's mechanism), over 40 × 8 rows × 7 heads
    × 128 dims at positions up to 524287."""
    flips, total = 0, 0
    for seed in range(40):
        case = Case("sweep", 6, 1, 128, 32, 1e6, 524288, 8, 8)
        inp = make_inputs(case, 1000 + seed)
        flat = inp.qkv.float().reshape(8, 8, 128)
        pos = inp.pos.long()
        for x, w in ((flat[:, :6], inp.q_w), (flat[:, 6:7], inp.k_w)):
            x = x.bfloat16()
            ours = ops.rope(head_rms_norm_ref(x, w, EPS), pos, 32, 1e6)
            ref = ops.rope(ops.rms_norm(x, w, EPS), pos, 32, 1e6)
            check(ours.float(), ref.float(), "kernels.qk_rope.vs_reference", "bf16")
            flips += int((bits(ours) != bits(ref)).sum())
            total += ours.numel()
    print(f"\n  twin vs model path: {flips} of {total} bf16 elements differ")
    assert flips <= total // 10000, "the FP64-sum norm departs from ops.rms_norm too often"


@pytest.mark.slow
def test_partials_path_equals_reduced_bf16_path(device):
    """qk_rope on linear_fp8_partials gives the bits of qk_rope on linear_fp8(out bf16): both
    sum the partials s = 0 … S−1 and round once."""
    case = Case("tiny-qkv", 12, 2, 32, 8, 1e4, 4096, 8, 7, splits=3)
    gen = torch.Generator().manual_seed(70)
    x = torch.randn(8, 384, generator=gen).bfloat16()
    w, s = ops.quantize_block(torch.randn(case.width, 384, generator=gen))
    xd, wd, sd = x.to(device), w.to(device), s.to(device)
    n = torch.tensor([7], dtype=torch.int32, device=device)
    cfg = LinearLaunch(64, 3)
    part = linear_fp8_partials(xd, wd, sd, n, config=cfg)
    flat = linear_fp8(xd, wd, sd, n, config=cfg)
    assert part.shape[0] == 3
    table = rope_table(4096, 8, 1e4, device)
    base = make_inputs(case, 71)
    via_part = run_kernel(case, Inputs(part.cpu(), base.q_w, base.k_w, base.pos, base.n), table,
                          device)
    via_flat = run_kernel(case, Inputs(flat.cpu(), base.q_w, base.k_w, base.pos, base.n), table,
                          device)
    assert_bit_exact(via_part, via_flat, "partials vs bf16")


def rope_gptj(x: torch.Tensor, pos: torch.Tensor, rot: int, theta: float) -> torch.Tensor:
    """Mutant: GPT-J interleaved pairs (2i, 2i+1) instead of NeoX halves."""
    cos, sin = ops.rope_cos_sin(pos, rot, theta)
    cos, sin = cos[:, None], sin[:, None]
    xf = x.float().clone()
    a, b = xf[..., 0:rot:2].clone(), xf[..., 1:rot:2].clone()
    xf[..., 0:rot:2], xf[..., 1:rot:2] = a * cos - b * sin, b * cos + a * sin
    return xf.to(x.dtype)


def mutant(case: Case, inp: Inputs, kind: str):
    """q (and k) as a broken kernel would produce them, else the twin's arithmetic."""
    n, d = case.n_live, case.d
    qkv = inp.qkv[:n].bfloat16()
    q = qkv[:, : case.hq * d].reshape(n, case.hq, d)
    k = qkv[:, case.hq * d : (case.hq + case.hkv) * d].reshape(n, case.hkv, d)
    q_w, k_w = inp.q_w, inp.k_w
    if kind == "q-norm weight as 1 + w":
        q_w = 1.0 + q_w.float()
    if kind == "k-norm weight on q":
        q_w = k_w
    q, k = head_rms_norm_ref(q, q_w, EPS), head_rms_norm_ref(k, k_w, EPS)
    pos, rot, theta = inp.pos[:n].long(), case.rot, case.theta
    if kind == "position off by one":
        pos = pos + 1
    if kind == "rotary over all head dims":
        rot = d
    if kind == "other layer type's RoPE base":
        theta = 1e4 if theta == 1e6 else 1e6
    rope = rope_gptj if kind == "GPT-J pairs" else ops.rope
    return rope(q, pos, rot, theta), rope(k, pos, rot, theta)


MUTANTS = ("GPT-J pairs", "rotary over all head dims", "q-norm weight as 1 + w",
           "k-norm weight on q", "position off by one", "other layer type's RoPE base")


@pytest.mark.slow
def test_broken_variants_exceed_their_rows(device):
    """Each mutant fails the exact row against the kernel and the vs_reference row against the
    literal model path; a table built with the wrong base fails too (the twin reads no table)."""
    case = Case("rank-6of8", 6, 1, 128, 32, 1e6, 8192, 8, 6)
    inp = make_inputs(case, 81)
    table = rope_table(case.table_positions, case.rot, case.theta, device)
    got = run_kernel(case, inp, table, device)
    ref = model_path(case, inp)
    for kind in MUTANTS:
        q, k = mutant(case, inp, kind)
        with pytest.raises(AssertionError):
            check(bits(q), bits(got[0]), "kernels.qk_rope", "bf16")
        loose = [f"{t}: {err}" for t, a, b in (("q", q, ref[0]), ("k", k, ref[1]))
                 for err in [_fails(a, b)] if err]
        assert loose, f"{kind}: within kernels.qk_rope.vs_reference for both q and k"
        print(f"\n  broken: {kind}: {loose[0]}")
    wrong = rope_table(case.table_positions, case.rot, 1e4, device)
    bad = run_kernel(case, inp, wrong, device)
    with pytest.raises(AssertionError):
        check(bits(bad[0]), bits(twin(case, inp, table)[0]), "kernels.qk_rope", "bf16")


def _fails(a: torch.Tensor, b: torch.Tensor) -> str | None:
    try:
        check(a.float(), b.float(), "kernels.qk_rope.vs_reference", "bf16")
    except AssertionError as err:
        return str(err).split(";")[0]
    return None


@pytest.mark.slow
def test_positions_outside_the_table_give_nan_rows(device):
    case = Case("tiny-oob", 12, 2, 32, 8, 1e4, 100, 4, 4)
    inp = make_inputs(case, 90)
    pos = inp.pos.clone()
    pos[1], pos[3] = 100, -1
    inp = Inputs(inp.qkv, inp.q_w, inp.k_w, pos, inp.n)
    table = rope_table(100, 8, 1e4, device)
    dev = [t.to(device) for t in (inp.qkv, inp.q_w, inp.k_w, inp.pos, inp.n)]
    q, k, v = (t.cpu() for t in qk_rope(*dev[:4], table, dev[4], num_q_heads=12, num_kv_heads=2,
                                          eps=EPS))
    tq, tk, tv = twin(case, inp, table)
    for got, want in ((q, tq), (k, tk)):
        assert torch.isnan(got[[1, 3]]).all() and not torch.isnan(got[[0, 2]]).any()
        assert torch.equal(bits(got[[0, 2]]), bits(want[[0, 2]]))
        assert torch.isnan(want[[1, 3]]).all()
    assert torch.equal(bits(v), bits(tv))


def test_wrapper_errors(device):
    case = CASES[0]
    inp = make_inputs(case, 3)
    table = rope_table(64, 8, 1e4, device)
    qkv, qw, kw, pos = (t.to(device) for t in (inp.qkv, inp.q_w, inp.k_w, inp.pos))
    kw_args = dict(num_q_heads=12, num_kv_heads=2, eps=EPS)
    with pytest.raises(ValueError, match="qkv: expected dtype"):
        qk_rope(qkv.float(), qw, kw, pos, table, **kw_args)
    with pytest.raises(ValueError, match="not .* times the head dim"):
        qk_rope(qkv[:, :-1], qw, kw, pos, table, **kw_args)
    with pytest.raises(ValueError, match=r"q_norm_weight: expected shape \(32,\)"):
        qk_rope(qkv, qw[:16], kw, pos, table, **kw_args)
    with pytest.raises(ValueError, match="give both or neither"):
        qk_rope(qkv, qw, None, pos, table, **kw_args)
    with pytest.raises(ValueError, match=r"positions: expected shape \(8,\)"):
        qk_rope(qkv, qw, kw, pos[:3], table, **kw_args)
    with pytest.raises(ValueError, match="positions: expected dtype"):
        qk_rope(qkv, qw, kw, pos.float(), table, **kw_args)
    with pytest.raises(ValueError, match="table.rotary_dim: 64 exceeds the head dim 32"):
        qk_rope(qkv, qw, kw, pos, rope_table(4, 64, 1e4, device), **kw_args)
    with pytest.raises(ValueError, match="table: expected a RopeTable"):
        qk_rope(qkv, qw, kw, pos, table.cos_sin, **kw_args)
    with pytest.raises(ValueError, match=r"k_out: expected shape \(8, 2, 32\)"):
        qk_rope(qkv, qw, kw, pos, table, k_out=torch.empty(8, 1, 32, dtype=torch.bfloat16,
                                                           device=device), **kw_args)
    with pytest.raises(ValueError, match="eps: expected > 0"):
        qk_rope(qkv, qw, kw, pos, table, num_q_heads=12, num_kv_heads=2, eps=0.0)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope_table(8, 7, 1e4, device)


# --- the KV write fused into qk_rope (cache=…) ----------------------------------------------

FUSED = Case("fused", 4, 2, 32, 8, 1e4, 4096, 8, 8)
KV_LAYOUTS = {
    "ring16+7": KVLayout.make_ring(16, 7, 2, 32),
    "draft8+7": KVLayout.make_ring(8, 7, 2, 32, start=1),
    "full96": KVLayout.make_full(96, 2, 32),
}
# (layout, positions of the 8 rows, live rows): −7 marks padding rows (never read), −1 in a
# live row stores nothing, a full cache stores nothing at positions ≥ its capacity
WRITES = {
    "ring-wraps-6of8": ("ring16+7", [20, 21, 22, 23, 24, 25, -7, -7], 6),
    "ring-live-minus-one": ("ring16+7", [30, -1, 32, 33, 34, 35, 36, 37], 8),
    "draft-wraps-3of8": ("draft8+7", [14, 15, 16, -7, -7, -7, -7, -7], 3),
    "full-5of8": ("full96", [40, 41, 42, 43, 44, -1, -1, -1], 5),
    "full-past-capacity": ("full96", [92, 93, 94, 95, 96, 97, 98, 99], 8),
    "none-live": ("ring16+7", [5, 6, 7, 8, 9, 10, 11, 12], 0),
}


def _filled_cache(layout: KVLayout, seed: int, device) -> LayerKV:
    """Every slot holds data and a label, so a store to a wrong slot or a padding row shows."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.capacity, layout.kv_heads, layout.head_dim)
    k = torch.randn(shape, generator=gen).bfloat16().to(device)
    v = torch.randn(shape, generator=gen).bfloat16().to(device)
    labels = torch.arange(1000, 1000 + layout.capacity, dtype=torch.int32, device=device)
    return LayerKV(layout, k, v, labels)


def _fused_inputs(name: str, device):
    lay, positions, n = WRITES[name]
    seed = 300 + sorted(WRITES).index(name)
    inp = make_inputs(dataclasses.replace(FUSED, n_live=max(n, 1)), seed)
    inp = dataclasses.replace(inp, pos=torch.tensor(positions, dtype=torch.int32),
                              n=torch.tensor([n], dtype=torch.int32))
    dev = [t.to(device) for t in (inp.qkv, inp.q_w, inp.k_w, inp.pos, inp.n)]
    return KV_LAYOUTS[lay], inp, dev


def _same_cache(a: LayerKV, b: LayerKV, what: str) -> None:
    for name in ("k", "v", "slot_pos"):
        x, y = getattr(a, name).cpu(), getattr(b, name).cpu()
        if x.dtype == torch.bfloat16:
            x, y = x.view(torch.int16), y.view(torch.int16)
        assert torch.equal(x, y), f"{what}: cache.{name} differs at {int((x != y).sum())} elements"


@pytest.mark.parametrize("name", sorted(WRITES))
def test_fused_kv_write_equals_qk_rope_then_write_kv(name, device):
    layout, inp, dev = _fused_inputs(name, device)
    table = rope_table(FUSED.table_positions, FUSED.rot, FUSED.theta, device)
    args = dict(num_q_heads=FUSED.hq, num_kv_heads=FUSED.hkv, eps=EPS)
    fused, apart, twin_cache = (_filled_cache(layout, 7, device) for _ in range(3))
    got = qk_rope(*dev[:4], table, dev[4], cache=fused, **args)
    want = qk_rope(*dev[:4], table, dev[4], **args)
    write_kv(apart, want[1], want[2], dev[3], dev[4])
    n = int(inp.n[0])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(bits(a[:n]), bits(b[:n]))
    _same_cache(fused, apart, f"{name}: fused vs qk_rope + write_kv")
    twin_out = qk_rope_ref(inp.qkv, inp.q_w, inp.k_w, inp.pos, table, inp.n, cache=twin_cache,
                           **args)
    _same_cache(fused, twin_cache, f"{name}: fused vs qk_rope_ref + write_ref")
    for a, b in zip(got, twin_out, strict=True):
        live = inp.pos[:n] >= 0  # q, k of a row at −1 are NaN on both sides
        assert torch.equal(bits(a[:n][live]), bits(b[live]))
    stored = [p for p in WRITES[name][1][:n] if p >= 0 and (layout.ring or p < layout.capacity)]
    relabelled = fused.slot_pos.cpu() != _filled_cache(layout, 7, device).slot_pos.cpu()
    assert int(relabelled.sum()) == len(stored), "not every storable live row was stored"


def test_fused_kv_write_check_can_fail(device):
    """Mutant: a ring written as a full cache (slot = position): the wrapped rows land past
    the end (not stored) and the comparison with qk_rope + write_kv fails."""
    layout, _, dev = _fused_inputs("ring-wraps-6of8", device)
    table = rope_table(FUSED.table_positions, FUSED.rot, FUSED.theta, device)
    args = dict(num_q_heads=FUSED.hq, num_kv_heads=FUSED.hkv, eps=EPS)
    fused, apart = (_filled_cache(layout, 7, device) for _ in range(2))
    as_full = dataclasses.replace(fused, layout=dataclasses.replace(layout, ring=False))
    qk_rope(*dev[:4], table, dev[4], cache=as_full, **args)
    _, k, v = qk_rope(*dev[:4], table, dev[4], **args)
    write_kv(apart, k, v, dev[3], dev[4])
    with pytest.raises(AssertionError, match="differs"):
        _same_cache(fused, apart, "ring written as full")


def test_fused_kv_write_refuses_bad_caches(device):
    _, inp, dev = _fused_inputs("ring-wraps-6of8", device)
    table = rope_table(64, 8, 1e4, device)
    qkv, qw, kw, pos, n = dev
    args = dict(num_q_heads=FUSED.hq, num_kv_heads=FUSED.hkv, eps=EPS)
    good = KVLayout.make_ring(16, 7, 2, 32)

    def call(cache, positions=pos):
        qk_rope(qkv, qw, kw, positions, table, n, cache=cache, **args)

    with pytest.raises(ValueError, match="cache must be a reference.kv_layout.LayerKV"):
        call(torch.zeros(23, 2, 32, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match=r"cache.layout: qk_rope stores k, v \[R, 2, 32\]"):
        call(LayerKV.empty(KVLayout.make_ring(16, 7, 1, 32), device))
    with pytest.raises(ValueError, match=r"cache.layout: .* holds \[C, 2, 16\]"):
        call(LayerKV.empty(KVLayout.make_ring(16, 7, 2, 16), device))
    with pytest.raises(ValueError, match="cache.k: expected dtype torch.bfloat16"):
        call(LayerKV.empty(good, device, dtype=torch.float32))
    cache = LayerKV.empty(good, device)
    with pytest.raises(ValueError, match="cache.slot_pos must be int32"):
        call(dataclasses.replace(cache, slot_pos=cache.slot_pos.long()))
    with pytest.raises(ValueError, match="cache.v must be"):
        call(dataclasses.replace(cache, v=cache.v[:, :, :16]))
    with pytest.raises(ValueError, match="cache.k must be .* contiguous last dim"):
        call(dataclasses.replace(cache, k=cache.k.transpose(0, 2).contiguous().transpose(0, 2)))
    with pytest.raises(ValueError, match="positions: expected dtype torch.int32 with a cache"):
        call(cache, pos.long())
    with pytest.raises(ValueError, match="cache: 8 rows exceed its 4 slots"):
        call(LayerKV.empty(KVLayout.make_ring(4, 0, 2, 32), device))
    labels = cache.slot_pos.clone()
    call(cache)  # the good cache is accepted, and the refused calls wrote nothing
    assert not torch.equal(cache.slot_pos, labels)


def test_rows_are_in_the_table():
    assert tolerance("kernels.qk_rope", "bf16").exact
    assert not tolerance("kernels.qk_rope.vs_reference", "bf16").exact


SM90_QK_ROPE = dict(
    module="qk_rope", kernel="_qk_rope_kernel",
    sig=dict(qkv_ptr="*fp32", qw_ptr="*bf16", kw_ptr="*bf16", pos_ptr="*i32", tab_ptr="*fp32",
             n_live_ptr="*i32", q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", ck_ptr="*bf16",
             cv_ptr="*bf16", label_ptr="*i32", eps="fp32"),
    const=dict(stride_c=1, HQ=6, HKV=1, D=128, ROT=32, S=8, NORM=True, WRITE_KV=True, RING=True,
               BLOCK_D=128, BLOCK_R=1, INTERPRET=False, PDL=False),
    patterns=(r"fma\.rn\.f32", r"mul\.rn\.f32", r"div\.rn\.f32", r"div\.full", r"div\.approx",
              r"sqrt\.rn\.f32", r"sqrt\.approx", r"rsqrt", r"add\.(rn\.)?f64"),
    warps=1)


@pytest.mark.slow
def test_qk_rope_compiles_for_sm90_without_fma():
    """Without a GPU: compiled for sm_90, the kernel has no FMA with enable_fp_fusion off (as the
    wrapper launches it) nor on (as the folded QKV launch compiles it): RoPE's two products are
    explicit mul.rn, which no contraction touches; IEEE div.rn / sqrt.rn and an FP64 sum."""
    off, on = fusion_counts(**SM90_QK_ROPE)
    print(f"\n  sm_90: {off} / fusion on: {on}")
    assert off["fma\\.rn\\.f32"] == 0 and on["fma\\.rn\\.f32"] == 0, "an FMA in RoPE"
    assert off["mul\\.rn\\.f32"] >= 2 and on["mul\\.rn\\.f32"] >= 2, "RoPE's products"
    assert off["div\\.rn\\.f32"] >= 2 and off["sqrt\\.rn\\.f32"] >= 1
    assert off["div\\.full"] == off["div\\.approx"] == off["sqrt\\.approx"] == off["rsqrt"] == 0
    assert off["add\\.(rn\\.)?f64"] > 0


# --- GPU only -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n_live", [1, 6, 8])
@pytest.mark.parametrize("theta", [1e6, 1e4])
def test_rank_shape_with_full_table(n_live, theta, device):
    case = Case(f"rank-{n_live}of8", 6, 1, 128, 32, theta, 524288, 8, n_live, splits=8)
    inp = make_inputs(case, 200 + n_live)
    table = rope_table(524288, 32, theta, device)
    got = run_kernel(case, inp, table, device)
    assert_bit_exact(got, twin(case, inp, table), case.name)


@pytest.mark.gpu
def test_cuda_graph_and_no_host_sync(device):
    case = Case("rank-graph", 6, 1, 128, 32, 1e6, 4096, 8, 8, splits=8)
    inp = make_inputs(case, 210)
    table = rope_table(4096, 32, 1e6, device)
    qkv, qw, kw, pos = (t.to(device) for t in (inp.qkv, inp.q_w, inp.k_w, inp.pos))
    pos.copy_(torch.arange(1000, 1008, dtype=torch.int32, device=device))
    n = torch.tensor([8], dtype=torch.int32, device=device)
    outs = [poisoned((8, h, 128), device) for h in (6, 1, 1)]
    args = dict(num_q_heads=6, num_kv_heads=1, eps=EPS, q_out=outs[0], k_out=outs[1],
                v_out=outs[2])
    qk_rope(qkv, qw, kw, pos, table, n, **args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        qk_rope(qkv, qw, kw, pos, table, n, **args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        qk_rope(qkv, qw, kw, pos, table, n, **args)
    for live in (3, 8):
        for t in outs:
            t.copy_(poisoned(t.shape, device))
        n.fill_(live)
        graph.replay()
        torch.cuda.synchronize()
        case_n = Case("g", 6, 1, 128, 32, 1e6, 4096, 8, live, splits=8)
        want = twin(case_n, Inputs(inp.qkv, inp.q_w, inp.k_w, pos.cpu(), torch.tensor([live])),
                    table)
        assert_bit_exact(tuple(t.cpu()[:live] for t in outs), want, f"graph n={live}")
        assert all((bits(t[live:]) == POISON).all() for t in outs)
