"""kernels.qk_rope.qkv_rope — the QKV projection with qk_rope folded into its launch by the last
arrival of each head group (kernels/arrival.py) — against the two launches it replaces,
kernels.linear.linear_fp8_partials then kernels.qk_rope.qk_rope (with the KV write): the same
partials, q, k, v and cache bits, padding rows untouched, every counter back to 0. Its twin
(reference/twins/qk_rope.py qkv_rope_ref) within the linear's tolerance row.

Shapes cover channel tiles narrower than a head (several tiles and splits per counter), wider
(one tile holds several heads; a last group with fewer heads), ring and full caches.

Dimension letters: R buffer rows, n live rows, S splits, Hq / Hkv heads, D head dim, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from iquestrt.capture import graph_capture
from kernels.kv_cache import KVLayout, LayerKV
from kernels.linear import LinearLaunch, linear_fp8_partials
from kernels.qk_rope import QkvRopeScratch, qk_rope, qkv_rope, rope_table
from qualification.tolerances import check
from reference import ops
from reference.twins.qk_rope import qk_rope_ref, qkv_rope_ref
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
    hidden: int
    config: LinearLaunch
    positions: tuple[int, ...]  # of the 8 buffer rows; −7: padding
    n_live: int
    layout: KVLayout | None
    norm: bool = True

    @property
    def width(self) -> int:
        return (self.hq + 2 * self.hkv) * self.d


CASES = (
    # tiles of 16 channels, 2 per head, 2 splits of 2 blocks (the second one past K): 4
    # arrivals per head; the linear program's scales hoisted and its x loaded before n_live
    # (LinearLaunch.hoist_scales, early_loads)
    Case("tile16-d32-ring-6of8", 4, 2, 32, 8, 384,
         LinearLaunch(16, 2, hoist_scales=True, early_loads=True),
         (20, 21, 22, 23, 24, 25, -7, -7), 6, KVLayout.make_ring(16, 7, 2, 32)),
    # tiles of 64 channels: 2 heads per group, 2 splits
    Case("tile64-d32-full-5of8", 4, 2, 32, 8, 256, LinearLaunch(64, 2),
         (40, 41, 42, 43, 44, -1, -1, -1), 5, KVLayout.make_full(96, 2, 32)),
    # 5 heads of 16 in tiles of 64: groups of 4 heads, the last holds one
    Case("tile64-d16-odd-heads-8of8", 3, 1, 16, 16, 384, LinearLaunch(64, 3),
         (3, 4, 5, 6, 7, 8, 9, 10), 8, KVLayout.make_ring(16, 7, 1, 16), norm=False),
    Case("no-cache-none-live", 4, 2, 32, 8, 256, LinearLaunch(32, 2),
         (5, 6, 7, 8, 9, 10, 11, 12), 0, None),
)


def poisoned(shape, device) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=torch.int16, device=device).view(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def filled_cache(layout: KVLayout | None, device) -> LayerKV | None:
    """Every slot holds data and a label, so a store to a wrong slot shows."""
    if layout is None:
        return None
    gen = torch.Generator().manual_seed(7)
    shape = (layout.capacity, layout.kv_heads, layout.head_dim)
    k = torch.randn(shape, generator=gen).bfloat16().to(device)
    v = torch.randn(shape, generator=gen).bfloat16().to(device)
    labels = torch.arange(1000, 1000 + layout.capacity, dtype=torch.int32, device=device)
    return LayerKV(layout, k, v, labels)


def inputs(case: Case, seed: int, device) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, case.hidden, generator=gen).bfloat16()
    x[case.n_live:] = float("nan")  # padding rows: never read
    w, s = ops.quantize_block(torch.randn(case.width, case.hidden, generator=gen) / 8)
    norms = [(torch.rand(case.d, generator=gen) + 0.5).bfloat16() if case.norm else None
             for _ in range(2)]
    d = dict(x=x, w=w, s=s, q_norm=norms[0], k_norm=norms[1],
             pos=torch.tensor(case.positions, dtype=torch.int32),
             n=torch.tensor([case.n_live], dtype=torch.int32))
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def outs(case: Case, device) -> dict:
    return dict(q_out=poisoned((8, case.hq, case.d), device),
                k_out=poisoned((8, case.hkv, case.d), device),
                v_out=poisoned((8, case.hkv, case.d), device))


def run_fused(case, d, table, scratch, cache, device):
    parts = torch.full((case.config.split_k, 8, case.width), float("nan"), device=device)
    return qkv_rope(d["x"], d["w"], d["s"], d["q_norm"], d["k_norm"], d["pos"], table, d["n"],
                    num_q_heads=case.hq, num_kv_heads=case.hkv, eps=EPS, scratch=scratch,
                    partials=parts, config=case.config, cache=cache, **outs(case, device))


def run_apart(case, d, table, cache, device):
    parts = linear_fp8_partials(d["x"], d["w"], d["s"], d["n"], config=case.config)
    return (parts, *qk_rope(parts, d["q_norm"], d["k_norm"], d["pos"], table, d["n"],
                            num_q_heads=case.hq, num_kv_heads=case.hkv, eps=EPS, cache=cache,
                            **outs(case, device)))


def differences(case, got, want, got_cache, want_cache) -> list[str]:
    """What differs between the fused and the two-launch results (empty: the same bits)."""
    n, bad = case.n_live, []
    for name, a, b in zip(("partials", "q", "k", "v"), got, want, strict=True):
        a, b = (a[:, :n], b[:, :n]) if name == "partials" else (a[:n], b[:n])
        if not torch.equal(bits(a), bits(b)):
            bad.append(name)
    for name, t in zip("qkv", got[1:], strict=True):
        if not (bits(t[n:]) == POISON).all():
            bad.append(f"{name} padding rows written")
    if got_cache is not None:
        for name in ("k", "v", "slot_pos"):
            if not torch.equal(bits(getattr(got_cache, name)), bits(getattr(want_cache, name))):
                bad.append(f"cache.{name}")
    return bad


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fused_launch_gives_the_two_launches_bits(case, device):
    d = inputs(case, 40 + CASES.index(case), device)
    table = rope_table(4096, case.rot, 1e4, device)
    scratch = QkvRopeScratch.create(device)
    fused_cache, apart_cache = filled_cache(case.layout, device), filled_cache(case.layout, device)
    want = run_apart(case, d, table, apart_cache, device)
    for call in range(2):  # the second call finds the counters the first one left
        cache = filled_cache(case.layout, device)
        got = run_fused(case, d, table, scratch, cache if call else fused_cache, device)
        assert differences(case, got, want, cache if call else fused_cache, apart_cache) == []
        assert int(scratch.counters.abs().sum()) == 0, "a counter left off 0"
    if case.n_live and case.layout is not None:
        relabelled = fused_cache.slot_pos.cpu() != filled_cache(case.layout, device).slot_pos.cpu()
        lay = case.layout
        assert int(relabelled.sum()) == sum(p >= 0 and (lay.ring or p < lay.capacity)
                                            for p in case.positions[:case.n_live])


def test_a_broken_handoff_is_caught(device):
    """Control: a counter left off 0 — here far from any arrival count, as after a launch that
    died between its arrivals and the finisher's reset — lets no program of its group see
    itself last: the group's heads are never finished, so the comparison fails and the counter
    stays off 0, on every device and in any program order. (A counter one arrival ahead runs
    the finish one arrival early instead; whether the last arrival's add then lands before or
    after the finisher's reset is a race on a GPU — measured there as 0 — so that case cannot
    be a deterministic control.) reset() restores the invariant."""
    case = CASES[0]
    d = inputs(case, 40, device)
    table = rope_table(4096, case.rot, 1e4, device)
    want = run_apart(case, d, table, filled_cache(case.layout, device), device)
    scratch = QkvRopeScratch.create(device)
    scratch.counters[0] = 1 << 20
    cache = filled_cache(case.layout, device)
    got = run_fused(case, d, table, scratch, cache, device)
    assert int(scratch.counters[0]) > 1 << 20 and int(scratch.counters[1:].abs().sum()) == 0
    assert "q" in differences(case, got, want, None, None)
    scratch.reset()
    got = run_fused(case, d, table, scratch, filled_cache(case.layout, device), device)
    assert differences(case, got, want, None, None) == []


def test_twin_is_linear_partials_then_qk_rope(device):
    """qkv_rope_ref's partials sum to the kernel's within kernels.linear_fp8's row, and its q, k,
    v on the kernel's own partials are the kernel's bits (qk_rope_ref is exact)."""
    case = CASES[0]
    d = inputs(case, 41, device)
    table = rope_table(4096, case.rot, 1e4, device)
    got = run_fused(case, d, table, QkvRopeScratch.create(device), None, device)
    args = dict(num_q_heads=case.hq, num_kv_heads=case.hkv, eps=EPS)
    n = case.n_live
    parts, q, k, v = qkv_rope_ref(d["x"].cpu(), d["w"].cpu(), d["s"].cpu(), d["q_norm"].cpu(),
                                  d["k_norm"].cpu(), d["pos"].cpu(), table, d["n"].cpu(),
                                  splits=case.config.split_k, **args)
    check(got[0][:, :n].sum(0).cpu(), parts.sum(0), "kernels.linear_fp8", "fp32")
    on_ours = qk_rope_ref(got[0].cpu(), d["q_norm"].cpu(), d["k_norm"].cpu(), d["pos"].cpu(),
                          table, d["n"].cpu(), **args)
    for a, b in zip(got[1:], on_ours, strict=True):
        assert torch.equal(bits(a[:n]), bits(b))
    assert q.shape == (n, case.hq, case.d) and k.shape == v.shape == (n, case.hkv, case.d)


def test_bad_arguments_raise_before_any_launch(device):
    case = CASES[0]
    d = inputs(case, 42, device)
    table = rope_table(4096, case.rot, 1e4, device)
    args = dict(num_q_heads=case.hq, num_kv_heads=case.hkv, eps=EPS)
    call = (d["x"], d["w"], d["s"], d["q_norm"], d["k_norm"], d["pos"], table, d["n"])
    with pytest.raises(ValueError, match="scratch"):
        qkv_rope(*call, scratch=None, config=case.config, **args)
    small = QkvRopeScratch(torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="head groups exceed"):
        qkv_rope(*call, scratch=small, config=case.config, **args)
    with pytest.raises(ValueError, match="width"):
        qkv_rope(*call, scratch=QkvRopeScratch.create(device), config=case.config,
                 num_q_heads=case.hq + 1, num_kv_heads=case.hkv, eps=EPS)
    # head dim 24 (3 + 2 heads of 24 = 120 channels) in tiles of 16: neither divides the other
    w, s = ops.quantize_block(torch.randn(120, 384))
    with pytest.raises(ValueError, match="channel tile"):
        qkv_rope(d["x"], w.to(device), s.to(device), None, None, d["pos"], table, d["n"],
                 num_q_heads=3, num_kv_heads=1, eps=EPS, scratch=QkvRopeScratch.create(device),
                 config=LinearLaunch(16, 3))


@pytest.mark.slow
def test_fused_kernel_compiles_for_sm90():
    """Without a GPU, at the rank's shape (6 + 2 heads of 128, H 3072, tiles of 64, 8 splits):
    the launch builds; its handoff is one acq_rel atomic and volatile reloads; RoPE's products
    stay explicit mul.rn and its norm an FP64 sum (the standalone kernel's arithmetic)."""
    ptr = dict(xq_ptr="*fp8e4nv", sx_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32",
               n_live_ptr="*i32", parts_ptr="*fp32", cnt_ptr="*i32", qw_ptr="*bf16",
               kw_ptr="*bf16", pos_ptr="*i32", tab_ptr="*fp32", q_ptr="*bf16", k_ptr="*bf16",
               v_ptr="*bf16", ck_ptr="*bf16", cv_ptr="*bf16", label_ptr="*i32", eps="fp32")
    const = dict(K=3072, KB=3, BLOCK_N=64, BLOCK_R=16, GROUP_HEADS=1, ARRIVALS=16, HQ=6, HKV=1,
                 D=128, ROT=32, S=8, NORM=True, WRITE_KV=True, RING=True, BLOCK_D=128,
                 INTERPRET=False, HOIST=False, EARLY=False, PREFETCH=False, PDL=False)
    _, on = fusion_counts("qk_rope", "_qkv_rope_kernel", ptr, const,
                          (r"atom\.global\.gpu\.acq_rel", r"ld\.volatile", r"mul\.rn\.f32",
                           r"add\.(rn\.)?f64"))
    print(f"\n  sm_90: {on}")
    assert on["atom\\.global\\.gpu\\.acq_rel"] == 1 and on["ld\\.volatile"] >= 1
    assert on["mul\\.rn\\.f32"] >= 2 and on["add\\.(rn\\.)?f64"] > 0


# --- GPU only -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n_live", [1, 6, 8])
def test_rank_shape_in_a_replayed_graph(n_live, device):
    """The per-rank QKV (6 + 2 heads of 128 over H 3072, the pinned tiles of 64 × 8 splits:
    16 arrivals per head) into a ring: a captured graph replayed three times gives the two
    launches' bits each time, and the counters end at 0."""
    lay = KVLayout.make_ring(4096 + 64, 4096, 1, 128)
    case = Case(f"rank-{n_live}of8", 6, 1, 128, 32, 3072, LinearLaunch(64, 8),
                tuple(range(5000, 5000 + n_live)) + (-7,) * (8 - n_live), n_live, lay)
    d = inputs(case, 50 + n_live, device)
    table = rope_table(8192, 32, 1e6, device)
    want_cache = filled_cache(lay, device)
    want = run_apart(case, d, table, want_cache, device)
    scratch = QkvRopeScratch.create(device)
    cache = filled_cache(lay, device)
    parts = torch.empty(8, 8, case.width, device=device)
    o = outs(case, device)

    def call():
        return qkv_rope(d["x"], d["w"], d["s"], d["q_norm"], d["k_norm"], d["pos"], table,
                        d["n"], num_q_heads=6, num_kv_heads=1, eps=EPS, scratch=scratch,
                        partials=parts, config=case.config, cache=cache, **o)

    got = call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        call()
    for _ in range(3):
        for t in o.values():
            t.copy_(poisoned(t.shape, device))
        graph.replay()
        torch.cuda.synchronize()
        assert differences(case, got, want, cache, want_cache) == []
        assert int(scratch.counters.abs().sum()) == 0
