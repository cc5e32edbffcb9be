"""Split-KV decode/verification attention vs its twin (reference.twins.attention.attention_ref) and
vs ops.attention over the complete history; visibility read back through the slot labels;
broken variants that must fail; bit-exact gates; NaN-poisoned outputs and garbage padding.

Shapes: the tiny preset's heads (Hq 12, Hkv 2, D 32: 6 query heads per KV head, like a rank
of the real model), rings 16 + 8 (target) and 8 + 7 (draft, start 1), a full cache of 96.
Dimension letters: R rows (kernel width), Hq/Hkv heads, D head dim, C slots, P positions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels.attention import (
    Partials,
    _launch_split,
    attention,
    attention_combine,
    attention_split,
    pick_config,
)
from kernels.kv_cache import KVLayout, LayerKV, rollback, write_kv
from qualification.tolerances import check
from reference import ops
from reference.twins.attention import attention_ref, window_positions
from reference.twins.kv_cache import write_ref

HQ, HKV, D = 12, 2, 32
SCALE = D**-0.5
F32 = "bf16-in/fp32-out"

LAYOUTS = {
    "ring16+8": KVLayout.make_ring(16, 8, HKV, D),
    "draft8+7": KVLayout.make_ring(8, 7, HKV, D, start=1),
    "full96": KVLayout.make_full(96, HKV, D),
}


@dataclass
class Scene:
    cache: LayerKV
    k_all: torch.Tensor  # [P, Hkv, D] every position's key (index = position)
    v_all: torch.Tensor  # [P, Hkv, D]
    q: torch.Tensor  # [R, Hq, D]; padding rows hold NaN
    q_pos: torch.Tensor  # [R] int32; padding rows hold garbage positions
    n_live: int
    sink: torch.Tensor  # [Hkv, D]

    def truth(self, sink: bool = True) -> torch.Tensor:
        """ops.attention over the complete history (no ring, no gather): [n_live, Hq, D]."""
        lay, n = self.cache.layout, self.n_live
        k_pos = torch.arange(lay.start, self.k_all.shape[0])
        return ops.attention(
            self.q[:n].cpu(), self.k_all[lay.start :], self.v_all[lay.start :],
            self.q_pos[:n].cpu().long(), k_pos, lay.window, self.sink.cpu() if sink else None,
            SCALE, out_dtype=torch.float32,
        )


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


def make_scene(layout, n, width, n_live, seed, device, *, write=write_kv) -> Scene:
    """Positions start … n−1 committed (twin writes), then the round's n_live rows at n … are
    written with the KV kernel before anything reads. Sentinel keys (equal huge logits,
    distinctive values) sit at every live row's window boundary t−W, t−W+1 and at t+1."""
    gen = torch.Generator().manual_seed(seed)
    total = n + n_live
    k_all = _bf16(torch.randn(total, HKV, D, generator=gen))
    v_all = _bf16(torch.randn(total, HKV, D, generator=gen))
    u = torch.randn(D, generator=gen)
    u = u / u.norm()
    q = _bf16(torch.randn(width, HQ, D, generator=gen) + 4.0 * u)
    q[n_live:] = float("nan")
    for t in range(n, total):
        marks = [t + 1]
        if layout.window is not None:
            marks += [t - layout.window, t - layout.window + 1]
        for p in marks:
            if layout.start <= p < total:
                k_all[p] = _bf16(40.0 * u).expand(HKV, D)
                v_all[p] = _bf16(8.0 * torch.randn(HKV, D, generator=gen).sign())
    # sink logit s = scale·⟨q, sink⟩ ≈ the sentinels' logit, so O·sigmoid(L − s) moves O by O(1)
    sink = _bf16(38.0 * u + 2.0 * torch.randn(HKV, D, generator=gen))
    cache = LayerKV.empty(layout, device)
    hist = torch.arange(layout.start, n, dtype=torch.int32)
    write_ref(cache, k_all[layout.start : n], v_all[layout.start : n], hist, len(hist))
    q_pos = torch.arange(n, n + width, dtype=torch.int32)
    q_pos[n_live:] = torch.tensor([-1000, 10**6, 5, 2**30, -1, 7, 0, 3])[: width - n_live]
    k_new = torch.zeros(width, HKV, D, dtype=torch.bfloat16)
    v_new = torch.zeros(width, HKV, D, dtype=torch.bfloat16)
    k_new[:n_live], v_new[:n_live] = k_all[n:], v_all[n:]
    q_pos = q_pos.to(device)
    n_t = torch.tensor([n_live], dtype=torch.int32, device=device)
    write(cache, k_new.to(device), v_new.to(device), q_pos, n_t)
    return Scene(cache, k_all, v_all, q.to(device), q_pos, n_live, sink.to(device))


def run(scene: Scene, out_dtype=torch.float32, **kw) -> torch.Tensor:
    out = torch.full(scene.q.shape, float("nan"), dtype=out_dtype, device=scene.q.device)
    args = dict(sink_k=scene.sink, scale=SCALE, out=out, out_dtype=out_dtype) | kw
    n = torch.tensor([scene.n_live], dtype=torch.int32, device=scene.q.device)
    return attention(scene.q, scene.cache, scene.q_pos, n, **args)


def _wrap_n(layout: KVLayout, width: int) -> int:
    """A committed length whose round of `width` rows straddles the ring's second wrap."""
    return 2 * layout.capacity - width // 2 if layout.ring else 88


# --- values vs twin and vs the complete history -----------------------------------------------


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("width, n_live", [(1, 1), (4, 3), (8, 5), (8, 8)])
@pytest.mark.parametrize("where", ["wrap", "start"])
def test_matches_twin_and_history(device, name, width, n_live, where):
    layout = LAYOUTS[name]
    n = _wrap_n(layout, width) if where == "wrap" else layout.start + 3
    seed = 100 * sorted(LAYOUTS).index(name) + 10 * width + (where == "wrap")
    scene = make_scene(layout, n, width, n_live, seed=seed, device=device)
    parts = attention_split(scene.q, scene.cache, scene.q_pos, n_live, SCALE)
    outs = {}
    for dt in (torch.float32, torch.bfloat16):
        out = torch.full(scene.q.shape, float("nan"), dtype=dt, device=device)
        outs[dt] = attention_combine(parts, scene.q, scene.sink, n_live, SCALE, out,
                                     heads_per_program=pick_config(D, 0, True).combine_heads)
        assert torch.isfinite(outs[dt][:n_live]).all(), "a live output element was not written"
        assert torch.isnan(outs[dt][n_live:]).all(), "a padding row was written"
    twin = attention_ref(scene.q, scene.cache, scene.q_pos, n_live, scene.sink, SCALE,
                         out_dtype=torch.float32)[:n_live]
    truth = scene.truth()
    print(check(twin.cpu(), truth, "kernels.attention", F32))
    print(check(outs[torch.float32][:n_live].cpu(), twin.cpu(), "kernels.attention", F32))
    print(check(outs[torch.bfloat16][:n_live].float().cpu(), twin.cpu(), "kernels.attention",
                "bf16"))


@pytest.mark.slow
def test_full_cache_uses_many_splits(device):
    """The full-cache scene spreads over ≥ 5 splits, so every combine chain and its wrap
    (split 4 → chain 0) is exercised, and split LSEs differ by far more than the tolerance."""
    layout = LAYOUTS["full96"]
    scene = make_scene(layout, 88, 8, 8, seed=1, device=device)
    parts = attention_split(scene.q, scene.cache, scene.q_pos, 8, SCALE)
    used = torch.isfinite(parts.lse[:, :8]).any(dim=(1, 2))
    assert used.sum().item() >= 5
    spread = parts.lse[:, 0, 0][torch.isfinite(parts.lse[:, 0, 0])]  # row 0, head 0
    assert len(spread) >= 4 and (spread.max() - spread.min()).item() > 1.0
    # trips of 1, 2 and 8 splits (5+ splits: several trips, or all in one) only reorder the
    # FP32 sum: each stays within the fp32 row of the twin
    twin = attention_ref(scene.q, scene.cache, scene.q_pos, 8, scene.sink, SCALE,
                         out_dtype=torch.float32)
    for trip in (1, 2, 8):
        out = torch.empty(scene.q.shape, dtype=torch.float32, device=device)
        attention_combine(parts, scene.q, scene.sink, 8, SCALE, out, splits_per_trip=trip,
                          heads_per_program=4)
        print(trip, check(out.cpu(), twin.cpu(), "kernels.attention", F32))
    with pytest.raises(ValueError, match="splits_per_trip"):
        attention_combine(parts, scene.q, scene.sink, 8, SCALE, out, splits_per_trip=3)


# --- broken variants must fail the same comparisons ------------------------------------------


def _lse_blind_combine(parts: Partials, scene: Scene) -> torch.Tensor:
    """Mutant combine: the plain mean of the split outputs (no LSE weights), sink kept right."""
    n = scene.n_live
    lse = parts.lse[:, :n].cpu()  # [S, R, Hq]
    used = torch.isfinite(lse)
    o = torch.where(used[..., None], parts.o[:, :n].cpu(), 0.0).sum(0) / used.sum(0)[..., None]
    big_l = torch.logsumexp(lse, dim=0)  # [R, Hq]
    sk = scene.sink.cpu().float().repeat_interleave(HQ // HKV, dim=0)
    s = torch.einsum("rhd,hd->rh", scene.q[:n].cpu().float(), sk) * SCALE
    return o * torch.sigmoid(big_l - s)[..., None]


def _exact_w_ring(scene_args, device) -> torch.Tensor:
    """Mutant layout: a ring of exactly W slots, 8 rows written before reading. The public
    wrapper refuses it (and the twin's label check raises), so launch the kernels directly."""
    layout = KVLayout.make_ring(16, 0, HKV, D)
    scene = make_scene(layout, *scene_args, device=device)
    with pytest.raises(ValueError, match="needs >= window"):
        run(scene)
    with pytest.raises(ValueError, match="holds"):
        attention_ref(scene.q, scene.cache, scene.q_pos, scene.n_live, scene.sink, SCALE)
    n = torch.tensor([scene.n_live], dtype=torch.int32, device=device)
    parts = _launch_split(scene.q, scene.cache, scene.q_pos, n, SCALE, pick_config(D, 16, True))
    out = torch.full(scene.q.shape, float("nan"), dtype=torch.float32, device=device)
    return attention_combine(parts, scene.q, scene.sink, n, SCALE, out)[: scene.n_live]


def _with_window(scene: Scene, w: int) -> Scene:
    lay = dataclasses.replace(scene.cache.layout, window=w)
    return dataclasses.replace(scene, cache=dataclasses.replace(scene.cache, layout=lay))


MUTANTS = ["window+1", "window-1", "sink dropped", "sink of group g+1", "combine without LSE",
           "ring of exactly W slots"]


@pytest.mark.parametrize("mutant", MUTANTS)
@pytest.mark.slow
def test_broken_variants_fail(device, mutant):
    layout = LAYOUTS["ring16+8"]
    args = (_wrap_n(layout, 8), 8, 8, 11)
    scene = make_scene(layout, *args, device=device)
    truth = scene.truth()
    good = run(scene)[:8].cpu()
    print("production:", check(good, truth, "kernels.attention", F32))
    if mutant == "window+1":
        bad = run(_with_window(scene, 17))
    elif mutant == "window-1":
        bad = run(_with_window(scene, 15))
    elif mutant == "sink dropped":
        bad = run(scene, sink_k=None)
    elif mutant == "sink of group g+1":
        bad = run(scene, sink_k=scene.sink.roll(1, dims=0).contiguous())
    elif mutant == "combine without LSE":
        scene = make_scene(LAYOUTS["full96"], 88, 8, 8, 11, device=device)
        truth = scene.truth()
        parts = attention_split(scene.q, scene.cache, scene.q_pos, 8, SCALE)
        bad = _lse_blind_combine(parts, scene)
    else:
        bad = _exact_w_ring(args, device)
    bad = bad[:8].float().cpu()
    for dtype in (F32, "bf16"):
        with pytest.raises(AssertionError, match="outside tolerance") as err:
            check(bad, truth, "kernels.attention", dtype)
        print(mutant, err.value)
    rel = (bad - truth).abs().max() / truth.abs().max()
    assert rel > 0.05, f"{mutant}: moved outputs by only {rel:.3g} (not gross)"


# --- visibility through the position labels ---------------------------------------------------


def _attended(scene: Scene, cache: LayerKV, *, launch=None) -> list[set[int]]:
    """Positions each live row attended, read back through the slot labels: all keys zero
    (equal logits, no sink), value of slot s = one-hot e_(s mod D), one call per block of D
    slots; a row's output then holds 1/|attended| exactly at its attended slots."""
    c = cache.layout.capacity
    labels = cache.slot_pos.cpu()
    seen: list[set[int]] = [set() for _ in range(scene.n_live)]
    weights: list[list[float]] = [[] for _ in range(scene.n_live)]
    for base in range(0, c, D):
        k = torch.zeros_like(cache.k)
        v = torch.zeros_like(cache.v)
        for s in range(base, min(base + D, c)):
            v[s, :, s - base] = 1.0
        probe = dataclasses.replace(cache, k=k, v=v)
        if launch is None:
            out = attention(scene.q, probe, scene.q_pos, scene.n_live, None, SCALE,
                            out_dtype=torch.float32)
        else:
            out = launch(scene.q, probe, scene.q_pos, scene.n_live)
        out = out.cpu()
        for r in range(scene.n_live):
            w = out[r]  # [Hq, D]
            assert torch.equal((w > 0), (w[:1] > 0).expand_as(w)), "heads disagree on keys"
            for j in torch.nonzero(w[0] > 0).flatten().tolist():
                seen[r].add(int(labels[base + j].item()))
                weights[r].append(w[0, j].item())
    for r in range(scene.n_live):
        expect = 1.0 / max(1, len(seen[r]))
        assert all(abs(x - expect) <= 1e-5 * expect for x in weights[r]), "a slot seen twice"
    return seen


def _true_window(layout: KVLayout, t: int) -> set[int]:
    """From the window's definition (it counts the current token): a query at t sees t−W+1 … t
    (and nothing below start)."""
    return {p for p in range(layout.start, t + 1) if layout.window is None or t - p < layout.window}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.slow
def test_visibility_equals_true_window(device, name):
    layout = LAYOUTS[name]
    scene = make_scene(layout, _wrap_n(layout, 8), 8, 7, seed=5, device=device)
    seen = _attended(scene, scene.cache)
    for r in range(scene.n_live):
        t = int(scene.q_pos[r].item())
        assert seen[r] == _true_window(layout, t), f"row {r} at {t}"
        assert seen[r] == set(window_positions(layout, t))


@pytest.mark.parametrize("mutant", ["window+1", "window-1", "ring of exactly W slots"])
@pytest.mark.slow
def test_visibility_catches_mutants(device, mutant):
    layout = LAYOUTS["ring16+8"]
    if mutant == "ring of exactly W slots":
        layout = KVLayout.make_ring(16, 0, HKV, D)
    scene = make_scene(layout, _wrap_n(layout, 8), 8, 8, seed=5, device=device)
    cache, launch = scene.cache, None
    if mutant.startswith("window"):
        cache = _with_window(scene, 17 if mutant == "window+1" else 15).cache
    else:
        def launch(q, probe, q_pos, n_live):
            n = torch.tensor([n_live], dtype=torch.int32, device=device)
            parts = _launch_split(q, probe, q_pos, n, SCALE, pick_config(D, 16, True))
            out = torch.empty(q.shape, dtype=torch.float32, device=device)
            return attention_combine(parts, q, None, n, SCALE, out)
    seen = _attended(scene, cache, launch=launch)
    wrong = [r for r in range(8) if seen[r] != _true_window(layout, int(scene.q_pos[r]))]
    assert wrong, f"{mutant}: every row still saw its true window"


# --- bit-exact gates ------------------------------------------------------------------------


@pytest.mark.slow
def test_padded_width_equals_exact_width(device):
    """6 live rows in an 8-row call (large finite garbage q, garbage positions in padding) equal
    a 6-row call bit for bit, and the padding rows of the NaN-poisoned output stay NaN."""
    scene = make_scene(LAYOUTS["full96"], 88, 8, 6, seed=2, device=device)
    gen = torch.Generator().manual_seed(3)
    scene.q[6:] = _bf16(300.0 * torch.randn(2, HQ, D, generator=gen)).to(device)
    padded = run(scene, out_dtype=torch.bfloat16)
    exact = attention(scene.q[:6], scene.cache, scene.q_pos[:6], 6, scene.sink, SCALE)
    check(padded[:6], exact, "kernels.attention.bit_exact", "any")
    assert torch.isnan(padded[6:]).all()
    # negative control: a launch that treats the padding rows as live writes them
    leaky = torch.full_like(padded, float("nan"))
    attention(scene.q, scene.cache, scene.q_pos.clamp(0, 95), 8, scene.sink, SCALE, out=leaky)
    assert not torch.isnan(leaky[6:]).all()


def _round(cache, never, gen, n, r, a, device, width=8):
    """Write r of `width` rows at n … (both caches see the accepted a), roll back the rest."""
    k = _bf16(torch.randn(width, HKV, D, generator=gen)).to(device)
    v = _bf16(torch.randn(width, HKV, D, generator=gen)).to(device)
    pos = torch.arange(n, n + width, dtype=torch.int32, device=device)
    write_kv(cache, k, v, pos, torch.tensor([r], dtype=torch.int32, device=device))
    write_kv(never, k, v, pos, torch.tensor([a], dtype=torch.int32, device=device))
    rollback(cache, n + a, n + r)
    return n + a


@pytest.mark.parametrize("pad, second_width", [(8, 8), (8, 1), (0, 1)])
@pytest.mark.slow
def test_rolled_back_ring_reads_like_never_rejected(device, pad, second_width):
    """A round of 8 rows is rejected (2 or 0 accepted), the next round writes and reads. Output
    must equal, bit for bit, a ring that never saw the rejected rows. pad 0 is the negative
    control (ring of exactly W): the rejected rows evicted history the next row needs."""
    layout = KVLayout.make_ring(16, pad, HKV, D)
    gen = torch.Generator().manual_seed(9)
    cache, never = LayerKV.empty(layout, device), LayerKV.empty(layout, device)
    n = 0
    for r, a in [(8, 8), (8, 8), (8, 8), (8, 2), (8, 0)]:
        n = _round(cache, never, gen, n, r, a, device)
    q = _bf16(torch.randn(second_width, HQ, D, generator=gen)).to(device)
    pos = torch.arange(n, n + second_width, dtype=torch.int32, device=device)
    k = _bf16(torch.randn(second_width, HKV, D, generator=gen)).to(device)
    for c in (cache, never):
        write_kv(c, k, k, pos, second_width)
    outs = [attention(q, c, pos, second_width, None, SCALE) for c in (cache, never)]
    if pad >= 7:
        check(outs[0], outs[1], "kernels.attention.bit_exact", "any")
    else:
        with pytest.raises(AssertionError, match="not bit-exact"):
            check(outs[0], outs[1], "kernels.attention.bit_exact", "any")


def test_bad_inputs_are_named(device):
    scene = make_scene(LAYOUTS["ring16+8"], 30, 8, 8, seed=0, device=device)
    with pytest.raises(ValueError, match="q must be"):
        attention(scene.q.float(), scene.cache, scene.q_pos, 8, scene.sink, SCALE)
    with pytest.raises(ValueError, match="q_pos must be int32"):
        attention(scene.q, scene.cache, scene.q_pos.long(), 8, scene.sink, SCALE)
    with pytest.raises(ValueError, match="sink_k must be"):
        attention(scene.q, scene.cache, scene.q_pos, 8, scene.sink[:1], SCALE)
    with pytest.raises(ValueError, match="n_live must be"):
        attention(scene.q, scene.cache, scene.q_pos, torch.tensor([8]), scene.sink, SCALE)


# --- real per-rank shapes on the GPU ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ring4096+64", "full8192"])
@pytest.mark.parametrize("width, n_live", [(1, 1), (6, 6), (8, 8)])
def test_per_rank_shapes_gpu(kind, width, n_live):
    dev = torch.device("cuda")
    hq, hkv, d = 6, 1, 128
    if kind.startswith("ring"):
        layout = KVLayout.make_ring(4096, 64, hkv, d)
        n = 2 * layout.capacity - 3
    else:
        layout = KVLayout.make_full(8192, hkv, d)
        n = 5000
    gen = torch.Generator().manual_seed(0)
    cache = LayerKV.empty(layout, dev)
    lo = max(0, n - layout.capacity + 8)
    hist = torch.arange(lo, n + width, dtype=torch.int32)
    k = _bf16(torch.randn(len(hist), hkv, d, generator=gen)).to(dev)
    v = _bf16(torch.randn(len(hist), hkv, d, generator=gen)).to(dev)
    for i in range(0, len(hist), 8):
        m = min(8, len(hist) - i)
        write_kv(cache, k[i : i + m], v[i : i + m], hist[i : i + m].to(dev), m)
    q = _bf16(torch.randn(width, hq, d, generator=gen)).to(dev)
    sink = _bf16(4.0 * torch.randn(hkv, d, generator=gen)).to(dev)
    pos = torch.arange(n, n + width, dtype=torch.int32, device=dev)
    scale = d**-0.5
    twin = attention_ref(q, cache, pos, n_live, sink, scale, out_dtype=torch.float32)
    for dt, row in ((torch.float32, F32), (torch.bfloat16, "bf16")):
        out = attention(q, cache, pos, n_live, sink, scale, out_dtype=dt)
        print(check(out[:n_live].float().cpu(), twin[:n_live].cpu(), "kernels.attention", row))


# --- the compiled (non-interpreter) branches build for sm_90 ---------------------------------


def _compile_sm90() -> dict[str, dict[str, int]]:
    """Compile every kernel's production branch for sm_90 (no GPU needed: Triton's bundled
    ptxas) with the alignment a real launch specializes on; count key PTX instructions."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.attention as A
    import kernels.attention.combine as AC
    import kernels.kv_cache as KV
    from tests.kernels.sm90 import loop_facts

    def build(fn, args, consts, aligned=(), warps=4, stages=2):
        sig = {n: t for n, t in args} | {k: "constexpr" for k in consts}
        names = [n for n, _ in args]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages})
        ptx = k.asm["ptx"]
        got = {k: ptx.count(k) for k in ("cp.async.cg", "wgmma.mma_async", "mma.sync")}
        got["in_flight"] = loop_facts(k.asm["ttgir"])[1]
        got["shared"] = k.metadata.shared
        return got

    i32, stats = "i32", {}
    split_args = [("q_ptr", "*bf16"), ("pos_ptr", "*i32"), ("n_live_ptr", "*i32"),
                  ("k_ptr", "*bf16"), ("v_ptr", "*bf16"), ("po_ptr", "*fp32"), ("pl_ptr", "*fp32"),
                  ("R", i32), ("C", i32), ("START", i32), ("WINDOW", i32), ("qk_scale2", "fp32")]
    split_args += [(n, i32) for n in ("s_qr", "s_qh", "s_kc", "s_kh", "s_vc", "s_vh", "s_os",
                                      "s_or", "s_oh", "s_ls", "s_lr")]
    aligned = [n for n, t in split_args if t.startswith("*") or n.startswith("s_")]
    for name, ring, bm, more in (("split_ring", True, 64, 0), ("split_full", False, 64, 0),
                                 ("split_full_1row", False, 16, 0),
                                 ("split_full_stage_more", False, 64, 1)):
        cfg = A.pick_config(128, 4160 if ring else 131072, ring)
        stats[name] = build(A._split_kernel, split_args, {
            "G": 6, "D": 128, "BLOCK_M": bm, "BLOCK_N": cfg.block_n, "NUM_SPLITS": cfg.num_splits,
            "MIN_TILES": cfg.min_tiles_per_split, "RING": ring, "SLIDING": ring,
            "INTERPRET": False, "PDL": False}, aligned, cfg.num_warps, cfg.num_stages + more)
    comb_args = [("po_ptr", "*fp32"), ("pl_ptr", "*fp32"), ("q_ptr", "*bf16"),
                 ("sink_ptr", "*bf16"), ("out_ptr", "*bf16"), ("n_live_ptr", "*i32"),
                 ("oq_ptr", "*fp8e4nv"), ("os_ptr", "*fp32"), ("HQ", i32), ("scale", "fp32")]
    comb_args += [(n, i32) for n in ("s_os", "s_or", "s_oh", "s_ls", "s_lr", "s_qr", "s_qh",
                                     "s_sk", "s_outr", "s_outh", "s_oqr", "s_osr")]
    variants = ((1, 264, True, False), (16, 8, False, False), (1, 264, True, True))
    for hb, s, sink, quant in variants:
        name = f"combine_hb{hb}" + ("_quant" if quant else "")
        stats[name] = build(AC._combine_kernel, comb_args, {
            "G": 6, "D": 128, "S": s, "BLOCK_S": triton.next_power_of_2(s), "HB": hb,
            "SB": 64 if hb == 1 else 2, "HAS_SINK": sink, "INTERPRET": False, "QUANT": quant,
            "QGROUPS": max(1, hb * 128 // 128), "PDL": False})
    w_args = [("k_ptr", "*bf16"), ("v_ptr", "*bf16"), ("pos_ptr", "*i32"), ("n_live_ptr", "*i32"),
              ("ck_ptr", "*bf16"), ("cv_ptr", "*bf16"), ("label_ptr", "*i32")]
    w_args += [(n, i32) for n in ("C", "HKV", "D", "s_kr", "s_kh", "s_vr", "s_vh", "s_cc", "s_ch",
                                  "s_vc", "s_vch")]
    r_args = [("label_ptr", "*i32"), ("keep_ptr", "*i32"), ("written_ptr", "*i32"), ("C", i32)]
    for ring in (True, False):
        stats[f"write_ring{ring}"] = build(KV._write_kv_kernel, w_args, {
            "RING": ring, "BLOCK_H": 1, "BLOCK_D": 128, "PDL": False}, warps=1)
        stats[f"rollback_ring{ring}"] = build(KV._rollback_kernel, r_args, {
            "RING": ring, "BLOCK": 8, "EMPTY_LABEL": -1, "PDL": False}, warps=1)
    return stats


@pytest.mark.slow
def test_compiled_branches_build_for_sm90():
    """The interpreter runs the INTERPRET branches; this compiles the others (a fresh process:
    under TRITON_INTERPRET the decorated kernels are not compilable) and checks that the
    per-rank split loop streams K/V with cp.async and multiplies with wgmma."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("split_ring", "split_full"):
        assert stats[name]["cp.async.cg"] > 0 and stats[name]["wgmma.mma_async"] > 0, stats
    # the pinned 3 stages keep one K/V tile pair in flight during a tile's products; one stage
    # more keeps two (the lever GAP.md names for streaming long contexts: more keys in flight
    # per SM without more splits) and still fits one program per SM (sm_90: 227 KB)
    full, more = stats["split_full"], stats["split_full_stage_more"]
    assert full["in_flight"] == 2 and more["in_flight"] == 4, (full, more)
    assert more["shared"] <= 227 * 1024 and more["cp.async.cg"] > 0, more
    assert "combine_hb1_quant" in stats  # the quantizing combine builds for sm_90 too


@pytest.mark.slow
def test_combine_quantizes_its_output(device):
    """attention(quant_out=…) fills quantize_act(out viewed [R, Hq·D]) bit for bit on the live
    rows and leaves padding rows alone; the output itself is unchanged; a launch whose programs
    do not cover whole 128-column groups, or a bad buffer, is refused by name."""
    from kernels.attention import combine_quantizes
    from kernels.fp8 import E4M3

    scene = make_scene(LAYOUTS["full96"], 88, 8, 6, seed=4, device=device)
    cfg = pick_config(D, scene.cache.layout.capacity, scene.cache.layout.ring)
    assert combine_quantizes(HQ, D, cfg.combine_heads), (HQ, D, cfg.combine_heads)
    # 384 columns = 3 groups; 192 = 1.5 (a partial last group); 4 heads × D = one group per
    # program, so programs past the first quantize at a column offset
    for hq, hb in ((HQ, cfg.combine_heads), (HQ // 2, cfg.combine_heads), (HQ, 4)):
        q = scene.q[:, :hq].contiguous()
        q8 = torch.full((8, hq * D), 0x55, dtype=torch.uint8, device=device).view(E4M3)
        sc = torch.full((8, -(-hq * D // 128)), 12288.0, device=device)
        plain = attention(q, scene.cache, scene.q_pos, 6, scene.sink, SCALE)
        out = attention(q, scene.cache, scene.q_pos, 6, scene.sink, SCALE,
                        config=dataclasses.replace(cfg, combine_heads=hb), quant_out=(q8, sc))
        assert torch.equal(out[:6].view(torch.int16), plain[:6].view(torch.int16))
        q_want, s_want = ops.quantize_act(out[:6].reshape(6, hq * D).cpu())
        assert torch.equal(q8[:6].cpu().view(torch.uint8), q_want.view(torch.uint8)), hq
        assert torch.equal(sc[:6].cpu(), s_want), hq
        assert (q8[6:].cpu().view(torch.uint8) == 0x55).all() and (sc[6:].cpu() == 12288.0).all()
    q8 = torch.empty(8, HQ * D, dtype=torch.uint8, device=device).view(E4M3)
    sc = torch.empty(8, HQ * D // 128, device=device)
    one_head = dataclasses.replace(cfg, combine_heads=1)  # 1 head × D = 32: a quarter group
    assert not combine_quantizes(HQ, D, 1)
    with pytest.raises(ValueError, match="whole 128-column groups"):
        attention(scene.q, scene.cache, scene.q_pos, 6, scene.sink, SCALE, config=one_head,
                  quant_out=(q8, sc))
    with pytest.raises(ValueError, match=r"quant_out\[1\]"):
        attention(scene.q, scene.cache, scene.q_pos, 6, scene.sink, SCALE, config=cfg,
                  quant_out=(q8, sc[:, :1]))


if __name__ == "__main__":
    print(json.dumps(_compile_sm90()))
