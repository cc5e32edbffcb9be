"""The engine with the "kernels" ops: the Triton kernels (interpreted on this CPU, so one short
run per test) against exact properties and against the twins / the matched reference.

Exact checks on the kernels path:
  * greedy speculative decoding emits at every position the argmax of the logits a plain prefill
    of the committed sequence computes: the kernels are batch-invariant (a row's bits do not
    depend on its batch-mates, padding or the chunk it came in), so verification rows, rollback
    and catch-up must not change any bit — and afterwards every target cache holds exactly the
    prefill's rows (cache_problems);
  * in lockstep (qualification/lockstep.py, strict: the first call outside its row raises),
    every kernel call agrees with its twin replayed on the same inputs under the op's row of
    qualification/tolerances.py (exact rows: qk_rope, KV writes and rollbacks, the sampler's ids
    and tokens, verify, the tails' quantization) — this checks the kernels adapters of
    iquestrt/ops.py with the engine's real arguments; the shared model code is checked bit for
    bit by test_engine.py (twins == the matched reference).
Kernels vs twins on tokens. The kernels round where the twins round but sum in other orders
(split-K GEMMs, split-KV attention, the tails' norms); a 1-ulp bf16 difference in an FP8-quantized
activation moves the E4M3 rounding of its 128-column group, so differences grow layer by layer
(measured on the tiny preset: identical rows for positions whose history never differed, up to
~0.7 logits elsewhere after 8 layers). Tokens may then flip where the reference's top-2 gap is
small. Every flip is counted and reported (run with -s), and must lie inside the band of the
kernels-vs-twins logit differences measured at the positions that did not flip; an unexplained
flip fails.
"""

from __future__ import annotations

import pytest
import torch

from iquestrt.config import RuntimeConfig
from iquestrt.engine import Engine
from iquestrt.weights import from_checkpoint
from qualification.lockstep import Lockstep
from reference.checkpoint import load_checkpoint
from reference.depth import FixedDepth
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest
from tests.helpers.engine_setup import GREEDY, SAMPLING, cache_problems, held, make_ckpt, prefill

pytestmark = pytest.mark.slow
PROMPT = (5,)  # short: every interpreted forward costs seconds
# The greedy test's prompt (1 + 8 − 1 committed positions = one prefill chunk): its 8 tokens take
# 3 rounds accepting 3, 0 and 1 of 3 drafts — a draft catch-up after a bonus, a full and a partial
# rejection, rounds reading a rolled-back cache (the test asserts it on the twins' rounds).
GREEDY_PROMPT = (250,)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return load_checkpoint(make_ckpt(tmp_path_factory.mktemp("corr"), "correlated"))


def _engine(ck, ops: str) -> Engine:
    # kernels need compiled launches on a GPU; on a CPU the interpreter (tests/conftest.py).
    # The twins stay on the CPU, where they equal the matched reference bit for bit.
    dev = "cuda" if torch.cuda.is_available() and ops == "kernels" else "cpu"
    # sync_rounds=1: no round is launched after the request ends (those run every op with 0 live
    # rows, which the lockstep's twins cannot replay; test_engine_graphs.py covers them)
    rcfg = RuntimeConfig(ops=ops, device=dev, ring_pad=8, max_positions=256, policy=FixedDepth(3),
                         sync_rounds=1)
    return Engine(from_checkpoint(ck, rcfg.device, 256), rcfg)


def _top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@pytest.mark.slow
def test_kernels_greedy_exact_round_semantics_and_explained_flips(ckpt):
    req = GenerationRequest(GREEDY_PROMPT, 8, GREEDY, 0)
    eng = _engine(ckpt, "kernels")
    lock = Lockstep(eng, strict=True)
    res = eng.generate(req)
    assert lock.calls >= 2 * len(res.rounds)
    assert set(lock.quantized) == {"MoE", "attention", "combine"}, \
        f"GEMMs taking a tail's quantization: {lock.quantized}"
    print("\nkernels vs twins on the same inputs, worst first:\n" + "\n".join(lock.report()))
    seq = list(GREEDY_PROMPT) + res.tokens
    committed = seq[:-1]  # the last emitted token is in no cache
    logits_k, _, caches = prefill(eng, committed)
    first = len(GREEDY_PROMPT) - 1
    assert logits_k[first:].argmax(-1).tolist() == res.tokens  # speculative == plain greedy
    # every target row whose context was committed has the prefill's logits, bit for bit
    rows = {tuple(c[1])[0] - 1: c[4] for c in lock.served if c[0] == 0}  # first position → rows
    compared = 0
    for m, a in [(first, 0)] + [(r.position, r.accepted) for r in res.rounds]:
        for j in range(a + 1):
            if m + j < len(committed):
                assert torch.equal(rows[m][j], logits_k[m + j]), f"position {m + j}"
                compared += 1
    assert compared >= len(res.rounds) + 1
    st = eng.session.caches
    assert st.target_len == len(committed)
    for i, layer in enumerate(st.target):
        assert cache_problems(layer, st.target_len, held(caches.target[i])) == [], f"layer {i}"
    # against the twins and the matched reference, on the kernels' own sequence
    logits_k = logits_k.cpu()
    twins = _engine(ckpt, "twins")
    logits_t, _, _ = prefill(twins, committed)
    model = ReferenceModel(ckpt.cfg, ckpt.dequantized(), "matched")
    ref = model.target(torch.tensor(committed), torch.arange(len(committed))).logits
    assert torch.equal(ref, logits_t)  # (test_engine.py shows this in general)
    dev = (logits_k - logits_t).abs().amax(-1)  # [T]
    flipped = (logits_k.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    steady = [p for p in range(len(committed)) if p not in flipped]
    band = float(dev[steady].max())
    gaps = {p: _top2_gap(ref[p]) for p in flipped}
    print(f"kernels greedy: tokens {res.tokens}, accepted {[r.accepted for r in res.rounds]}")
    print(f"kernels vs matched reference over {len(committed)} positions: {len(flipped)} "
          f"flip(s) {gaps}; logit band at the other positions {band:.3g}")
    for p, gap in gaps.items():
        assert gap <= 2 * band, f"flip at position {p}: top-2 gap {gap:.4g} > 2 × band {band:.4g}"
    t_res = twins.generate(req)
    accepted = [r.accepted for r in t_res.rounds]
    assert 3 in accepted[:-1] and 0 in accepted and {1, 2} & set(accepted), \
        f"the request no longer covers a catch-up, a full and a partial rejection: {accepted}"
    pairs = zip(res.tokens, t_res.tokens, strict=True)
    diverge = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    print(f"twins greedy: tokens {t_res.tokens} (first difference: token {diverge})")
    if diverge is None:
        assert [r.accepted for r in res.rounds] == [r.accepted for r in t_res.rounds]
    else:
        assert first + diverge in flipped, f"token {diverge} differs without a logit flip"


@pytest.mark.slow
def test_kernels_sampling_lockstep_and_twins(ckpt):
    req = GenerationRequest(PROMPT, 6, SAMPLING, 3)
    runs = {}
    for ops in ("kernels", "twins"):
        eng = _engine(ckpt, ops)
        lock = Lockstep(eng, strict=True)
        runs[ops] = (eng.generate(req), lock.served)
    (res, k_served), (t_res, t_served) = runs["kernels"], runs["twins"]
    print(f"\nkernels sampling: tokens {res.tokens}, accepted "
          f"{[(r.accepted, len(r.drafts)) for r in res.rounds]}; twins: tokens {t_res.tokens}")
    if res.tokens == t_res.tokens:
        assert [r.accepted for r in res.rounds] == [r.accepted for r in t_res.rounds]
        return
    # the runs differ: the first sampler call whose served rows differ must have seen different
    # logits (the lockstep above shows equal logits give equal decisions)
    for k, t in zip(k_served, t_served, strict=False):
        assert k[:2] == t[:2], "the runs diverged before any served row differed"
        k = [x.cpu() if isinstance(x, torch.Tensor) else x for x in k]
        if not (torch.equal(k[2], t[2]) and torch.allclose(k[3], t[3], rtol=0, atol=2.0**-21)):
            delta = float((k[4] - t[4]).abs().max())
            print(f"\nkernels vs twins (sampling): first different served row at purpose "
                  f"{k[0]}, positions {k[1]}; logits differ by up to {delta:.3g} there")
            assert delta > 0
            return
    raise AssertionError("tokens differ although every served row was the same")


@pytest.mark.slow
def test_kernels_checks_are_sensitive(ckpt, monkeypatch):
    """Broken variants fail early: an adapter passing a wrong residual scale to the MoE tail
    (the lockstep catches it at layer 1), and rings of exactly `window` slots (the attention
    kernel refuses them before reading)."""
    eng = _engine(ckpt, "kernels")
    Lockstep(eng, strict=True)
    tail = eng.ops.k.moe_tail
    monkeypatch.setattr(eng.ops.k, "moe_tail", lambda *a, **kw: tail(*a, **{
        **kw, "ffn_out_scale": 1.0}))
    with pytest.raises(AssertionError, match="outside tolerance"):
        eng.generate(GenerationRequest(PROMPT, 1, GREEDY, 0))
    eng = _engine(ckpt, "kernels")  # a tail whose scales are off by 2: the QKV check sees it
    Lockstep(eng, strict=True)
    tail = eng.ops.k.moe_tail

    def doubled(*a, **kw):
        out = tail(*a, **kw)
        if out.sx is not None:
            out.sx.mul_(2.0)
        return out

    monkeypatch.setattr(eng.ops.k, "moe_tail", doubled)
    with pytest.raises(AssertionError, match=r"kernels.quantize_act\[fp32\]"):
        eng.generate(GenerationRequest(PROMPT, 1, GREEDY, 0))
    eng = _engine(ckpt, "kernels")
    object.__setattr__(eng.rcfg, "ring_pad", 0)  # bypasses RuntimeConfig's check on purpose
    with pytest.raises(ValueError, match="ring of 16 slots cannot serve 8 rows"):
        eng.generate(GenerationRequest(PROMPT, 1, GREEDY, 0))


@pytest.mark.slow
def test_lockstep_report_names_op_layer_and_round(ckpt, monkeypatch):
    """Not strict: every call is recorded; a planted defect in layer 1's MoE tail adapter is
    reported first, with its op, layer and round, and the verdict fails; the clean run's report
    has no failure."""
    clean = Lockstep(_engine(ckpt, "kernels"))
    clean.eng.generate(GenerationRequest(PROMPT, 1, GREEDY, 0))
    assert clean.ok and clean.compared > 50, clean.report()
    eng = _engine(ckpt, "kernels")
    lock = Lockstep(eng)
    tail = eng.ops.k.moe_tail
    layer_1 = eng.w.layers[2].attn.attention_norm  # layer 1's tail normalizes for layer 2

    def broken(parts, h, next_norm, *a, **kw):
        if next_norm is layer_1:
            kw = {**kw, "ffn_out_scale": 1.0}
        return tail(parts, h, next_norm, *a, **kw)

    monkeypatch.setattr(eng.ops.k, "moe_tail", broken)
    eng.generate(GenerationRequest(PROMPT, 1, GREEDY, 0))
    assert not lock.ok
    first = lock.report()[0]
    assert first.startswith("kernels.residual_norm.moe_tail[bf16] L1 round 0"), lock.report()
    assert "outside tolerance" in first
    assert all(f.ok for f in lock.findings.values() if f.layer == "L0"), lock.report()


@pytest.mark.slow
def test_folded_qkv_launch_in_lockstep(ckpt, monkeypatch):
    """QkvLaunch.fold_rope (every layer's QKV projection and qk_rope in one launch): the strict
    lockstep gate judges each folded call — q, k, v and the cache exact against the twin's
    qk_rope on the kernel's own partials, the partials' sum within kernels.linear_fp8's row —
    through prefill and rounds, and the counters end at 0. (That the fold gives the two
    launches' bits: tests/kernels/test_qkv_rope.py.)"""
    from kernels import qk_rope as k_qk

    folded = []
    real = k_qk.qkv_rope
    monkeypatch.setattr(k_qk, "qkv_rope", lambda *a, **kw: folded.append(1) or real(*a, **kw))
    eng = _engine(ckpt, "kernels")
    eng.ops.qkv = k_qk.QkvLaunch(fold_rope=True)
    lock = Lockstep(eng, strict=True)
    res = eng.generate(GenerationRequest(PROMPT, 4, GREEDY, 0))
    layers = ckpt.cfg.target.num_hidden_layers
    assert len(folded) >= layers * (len(res.rounds) + 1)  # prefill + every round's forward
    assert lock.compared > 0 and lock.stopped == ""
    assert int(eng.ops.qkv_scratch.counters.abs().sum()) == 0
