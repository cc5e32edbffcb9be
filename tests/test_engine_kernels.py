"""The engine with the "kernels" ops: the Triton kernels (interpreted on this CPU, so one short
run per test) against exact properties and against the twins / the matched reference.

Exact checks on the kernels path:
  * greedy speculative decoding emits at every position the argmax of the logits a plain prefill
    of the committed sequence computes: the kernels are batch-invariant (a row's bits do not
    depend on its batch-mates, padding or the chunk it came in), so verification rows, rollback
    and catch-up must not change any bit — and afterwards every target cache holds exactly the
    prefill's rows (cache_problems);
  * in lockstep, every kernel call agrees with its twin replayed on the same inputs under the
    op's row of qualification/tolerances.py (exact rows: qk_rope, KV writes and rollbacks, the
    sampler's ids and tokens, verify) — this checks the kernels adapters of iquestrt/ops.py with
    the engine's real arguments; the shared model code is checked bit for bit by test_engine.py
    (twins == the matched reference).
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
from iquestrt.ops import TwinOps
from iquestrt.weights import from_checkpoint
from qualification.tolerances import check
from reference import ops as ref_ops
from reference.checkpoint import load_checkpoint
from reference.depth import FixedDepth
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest
from tests.test_engine_setup import GREEDY, SAMPLING, cache_problems, held, make_ckpt, prefill

pytestmark = pytest.mark.slow
PROMPT = (5,)  # short: every interpreted forward costs seconds; 1 + 8 − 1 positions = one chunk


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


class Lockstep:
    """Stands in for a kernels engine's ops: every call runs the kernel, then replays the twin on
    the same inputs (a clone of a cache it mutates) and compares live rows under the op's row of
    qualification/tolerances.py; every sampler call is recorded in order."""

    def __init__(self, eng: Engine):
        self.k, self.t = eng.ops, TwinOps(eng.w.device, 1)
        self.served, self.calls, self.margin = [], 0, {}
        self.quantized: dict[str, int] = {}  # producer tail → GEMMs that took its quantization
        eng.ops = eng.target.ops = eng.draft.ops = self

    def _cmp(self, got, want, op, dtype):
        m = check(got, want, op, dtype)
        self.margin[op, dtype] = max(self.margin.get((op, dtype), 0.0), m.max_rel)

    def __getattr__(self, name):  # reset(), name, …
        return getattr(self.k, name)

    def linear_fp8(self, x, lin, live, out_dtype):
        got, n = self.k.linear_fp8(x, lin, live, out_dtype), live.n
        dt = "bf16" if out_dtype == torch.bfloat16 else "fp32"
        self._cmp(got[:n], self.t.linear_fp8(x, lin, live, out_dtype)[:n], "kernels.linear_fp8",
                  dt)
        return got

    def _producer_quantization(self, x, xq, live, who: str) -> None:
        """A tail's quantization of its output must be the reference quantize_act(x), bit for bit
        (the twins engine's tails quantize on the CPU, the kernels' on the device)."""
        if xq is None:
            return
        n = live.n
        q, s = ref_ops.quantize_act(x[:n].cpu())
        assert torch.equal(xq[0][:n].cpu().view(torch.uint8), q.view(torch.uint8)), \
            f"the {who} tail's quantized values differ from quantize_act"
        assert torch.equal(xq[1][:n].cpu(), s), f"the {who} tail's scales differ from quantize_act"
        self.quantized[who] = self.quantized.get(who, 0) + 1

    def linear_fp8_partials(self, x, lin, live, xq=None, out=None):
        o_operand = xq is not None and xq is getattr(self, "o_quantized", None)
        self._producer_quantization(x, xq, live, "combine" if o_operand else "MoE")
        got, n = self.k.linear_fp8_partials(x, lin, live, xq=xq, out=out), live.n
        total = got[0, :n].clone()
        for s in range(1, got.shape[0]):
            total += got[s, :n]
        self._cmp(total, self.t.linear_fp8_partials(x, lin, live)[0, :n], "kernels.linear_fp8",
                  "fp32")
        return got

    def linear_bf16_f32(self, x, w, live, out_dtype):
        got, n = self.k.linear_bf16_f32(x, w, live, out_dtype), live.n
        op = ("kernels.linear_bf16_f32", "fp32") if out_dtype == torch.float32 else (
            "kernels.linear_fp8", "bf16")  # that row covers linear_bf16_f32's bf16 output too
        self._cmp(got[:n], self.t.linear_bf16_f32(x, w, live, out_dtype)[:n], *op)
        return got

    def qk_rope(self, parts, *a, **kw):
        got, want = self.k.qk_rope(parts, *a, **kw), self.t.qk_rope(parts, *a, **kw)
        n = a[4].n
        for g, w in zip(got, want, strict=True):
            self._cmp(g[:n], w[:n], "kernels.qk_rope", "bf16")
        return got

    def _mutating(self, name, cache, *a):
        twin_cache = cache.clone()
        getattr(self.k, name)(cache, *a)
        getattr(self.t, name)(twin_cache, *a)
        for f in ("k", "v", "slot_pos"):
            self._cmp(getattr(cache, f), getattr(twin_cache, f), "kernels.kv_write", "bf16/int32")

    def write_kv(self, cache, k, v, positions, live):
        self._mutating("write_kv", cache, k, v, positions, live)

    def rollback(self, cache, keep, written):
        self._mutating("rollback", cache, keep, written)

    def attention_q(self, q, cache, positions, live, sink_k, scale):
        got, oq = self.k.attention_q(q, cache, positions, live, sink_k, scale)
        want = self.t.attention(q, cache, positions, live, sink_k, scale)
        self._cmp(got[: live.n], want[: live.n], "kernels.attention", "bf16")
        if oq is not None:  # checked against quantize_act where the O projection takes it
            self.o_quantized = oq
        return got, oq

    def attention(self, q, cache, positions, live, sink_k, scale):
        got = self.k.attention(q, cache, positions, live, sink_k, scale)
        want = self.t.attention(q, cache, positions, live, sink_k, scale)
        self._cmp(got[: live.n], want[: live.n], "kernels.attention", "bf16")
        return got

    def attn_tail(self, parts, xn, aon, ffn, live, flag, **kw):
        got = self.k.attn_tail(parts, xn, aon, ffn, live, flag, **kw)
        want = self.t.attn_tail(parts, xn, aon, ffn, live, flag.clone(), **kw)
        n = live.n
        for f in ("h", "f_in"):
            self._cmp(getattr(got, f)[:n], getattr(want, f)[:n],
                      "kernels.residual_norm.attn_tail", "bf16")
        if got.ids is not None:
            self._cmp(got.ids[:n], want.ids[:n], "kernels.router.ids", "int32")
            self._cmp(got.weights[:n], want.weights[:n], "kernels.router.weights", "fp32")
        return got

    def norm_rows(self, a, w, live, eps, **kw):
        got = self.k.norm_rows(a, w, live, eps, **kw)
        want = self.t.norm_rows(a, w, live, eps, **{**kw, "y_out": None})
        n = live.n
        for g, t in zip(got, want, strict=True):
            if g is not None:
                self._cmp(g[:n], t[:n], "kernels.rows.norm",
                          "bf16" if g.dtype == torch.bfloat16 else "fp32")
        return got

    def draft_entry(self, *a):
        eh, pos = a[-2], a[-1]
        got = self.k.draft_entry(*a)
        want = self.t.draft_entry(*a[:-2], eh.clone(), pos.clone())
        n = a[6].n
        self._cmp(got[0][:n], want[0][:n], "kernels.rows.norm", "bf16")
        assert torch.equal(got[1], want[1]), "draft_entry positions differ from the twin"
        return got

    def eh_proj(self, *a):
        """Fused entry + projection == the kernel entry launch then the kernel linear, bit for
        bit (each of those compared with its twin as above)."""
        src, w, pos = a[:-2], a[-2], a[-1]
        live, embed = a[6], a[7]
        got = self.k.eh_proj(*a)
        eh = torch.zeros(pos.shape[0], 2 * embed.shape[1], dtype=torch.bfloat16,
                         device=pos.device)
        _, want_pos = self.draft_entry(*src, eh, pos.clone())
        want = self.linear_bf16_f32(eh, w, live, torch.bfloat16)
        assert torch.equal(got[0][: live.n], want[: live.n]), "fused eh_proj != entry + linear"
        assert torch.equal(got[1], want_pos), "eh_proj positions differ from the entry launch's"
        return got

    def silu_mul_rows(self, g, u, live):
        got = self.k.silu_mul_rows(g, u, live)
        self._cmp(got[: live.n], self.t.silu_mul_rows(g, u, live)[: live.n], "kernels.rows.silu",
                  "bf16")
        return got

    def route_rows(self, x, router_w, top_k, live):
        got = self.k.route_rows(x, router_w, top_k, live)
        want = self.t.route_rows(x, router_w, top_k, live)
        self._cmp(got[1][: live.n], want[1][: live.n], "kernels.rows.route", "int32")
        self._cmp(got[0][: live.n], want[0][: live.n], "kernels.rows.route", "fp32")
        return got

    def moe(self, x, weights, ids, m, live, out_dtype, xq=None, out=None):
        self._producer_quantization(x, xq, live, "attention")
        got = self.k.moe(x, weights, ids, m, live, out_dtype, xq=xq, out=out)
        want = self.t.moe(x, weights, ids, m, live, out_dtype)
        self._cmp(got[: live.n], want[: live.n], "kernels.moe.e2e", "bf16")
        return got

    def moe_tail(self, parts, h, next_norm, live, flag, **kw):
        got = self.k.moe_tail(parts, h, next_norm, live, flag, **kw)
        want = self.t.moe_tail(parts, h, next_norm, live, flag.clone(), **kw)
        self._cmp(got.xn[: live.n], want.xn[: live.n], "kernels.residual_norm.moe_tail", "bf16")
        return got

    def sample(self, logits, params, seed, positions, purpose, live):
        got = self.k.sample(logits, params, seed, positions, purpose, live)
        want = self.t.sample(logits, params, seed, positions, purpose, live)
        n = live.n
        self._cmp(got.tokens[:n], want.tokens[:n], "kernels.sampler.token", "int64")
        self._cmp(got.ids[:n], want.ids[:n], "kernels.sampler.ids", "int64")
        self._cmp(got.probs[:n], want.probs[:n], "kernels.sampler.probs", "fp32")
        self.served.append((int(purpose), positions[:n].tolist(), got.ids[:n].clone(),
                            got.probs[:n].clone(), logits[:n].clone()))
        self.calls += 1
        return got

    def verify(self, p, q_ids, q_probs, drafts, seed, first, n_drafts):
        got = self.k.verify(p, q_ids, q_probs, drafts, seed, first, n_drafts)
        want = self.t.verify(p, q_ids, q_probs, drafts, seed, first, n_drafts)
        for a, b in zip(got, want, strict=True):
            self._cmp(a.cpu(), b.cpu(), "kernels.verify", "int64")
        self.calls += 1
        return got


def _top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def test_kernels_greedy_exact_round_semantics_and_explained_flips(ckpt):
    req = GenerationRequest(PROMPT, 8, GREEDY, 0)
    eng = _engine(ckpt, "kernels")
    lock = Lockstep(eng)
    res = eng.generate(req)
    assert lock.calls >= 2 * len(res.rounds)
    assert set(lock.quantized) == {"MoE", "attention", "combine"}, \
        f"GEMMs taking a tail's quantization: {lock.quantized}"
    print("\nworst max_rel per op (kernels vs twins, same inputs): "
          + ", ".join(f"{op}[{dt}] {v:.2g}" for (op, dt), v in sorted(lock.margin.items())))
    seq = list(PROMPT) + res.tokens
    committed = seq[:-1]  # the last emitted token is in no cache
    logits_k, _, caches = prefill(eng, committed)
    first = len(PROMPT) - 1
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
    pairs = zip(res.tokens, t_res.tokens, strict=True)
    diverge = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    print(f"twins greedy: tokens {t_res.tokens} (first difference: token {diverge})")
    if diverge is None:
        assert [r.accepted for r in res.rounds] == [r.accepted for r in t_res.rounds]
    else:
        assert first + diverge in flipped, f"token {diverge} differs without a logit flip"


def test_kernels_sampling_lockstep_and_twins(ckpt):
    req = GenerationRequest(PROMPT, 6, SAMPLING, 3)
    runs = {}
    for ops in ("kernels", "twins"):
        eng = _engine(ckpt, ops)
        lock = Lockstep(eng)
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


def test_kernels_checks_are_sensitive(ckpt, monkeypatch):
    """Broken variants fail early: an adapter passing a wrong residual scale to the MoE tail
    (the lockstep catches it at layer 1), and rings of exactly `window` slots (the attention
    kernel refuses them before reading)."""
    eng = _engine(ckpt, "kernels")
    Lockstep(eng)
    tail = eng.ops.k.moe_tail
    monkeypatch.setattr(eng.ops.k, "moe_tail", lambda *a, **kw: tail(*a, **{
        **kw, "ffn_out_scale": 1.0}))
    with pytest.raises(AssertionError, match="outside tolerance"):
        eng.generate(GenerationRequest(PROMPT, 1, GREEDY, 0))
    eng = _engine(ckpt, "kernels")  # a tail whose scales are off by 2: the QKV check sees it
    Lockstep(eng)
    tail = eng.ops.k.moe_tail

    def doubled(*a, **kw):
        out = tail(*a, **kw)
        if out.sx is not None:
            out.sx.mul_(2.0)
        return out

    monkeypatch.setattr(eng.ops.k, "moe_tail", doubled)
    with pytest.raises(AssertionError, match="scales differ"):
        eng.generate(GenerationRequest(PROMPT, 1, GREEDY, 0))
    eng = _engine(ckpt, "kernels")
    object.__setattr__(eng.rcfg, "ring_pad", 0)  # bypasses RuntimeConfig's check on purpose
    with pytest.raises(ValueError, match="ring of 16 slots cannot serve 8 rows"):
        eng.generate(GenerationRequest(PROMPT, 1, GREEDY, 0))
