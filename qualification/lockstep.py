"""Lockstep gate — every kernel call of the engine against its twin on the identical inputs.

`Lockstep` stands in for a kernels engine's op table (iquestrt/ops.py): each call runs the
production kernel, then the twin (iquestrt/ops_twins.py) on the same inputs — on a clone of any
cache the op mutates — and judges the live rows by the op's row of qualification/tolerances.py:
exact rows (qk_rope, KV writes and rollbacks, routing ids, the sampler's ids and tokens, verify,
the tails' quantized values and scales) with torch.equal, the others by their band. Judging
each call on its own inputs separates a kernel's error from the drift it inherits: a defect
shows at the op that makes it, not layers later as an end-to-end band would.

The report (`Lockstep.report`) lists, worst first, op, dtype, layer, round and the share of the
row used (or the count of mismatching elements of an exact row). Layers are named from the
engine's weights and caches (L3.qkv, L3.attn, draft.moe …); the ops between a layer's
attention and the next layer's take that layer's name. Round k is the span between the k-th and
the (k+1)-th verify call (round 0 includes the prefill).

`run()` is the qualify gate: the trained mini model on the kernels engine at each (width,
depth) of the config, a prefill then sampled rounds. Compiled on a GPU; under the interpreter
on a CPU, where one chunk of prefill and two rounds at width 4 take about a minute (every
interpreted launch runs its programs one by one).

Dimension letters: R rows, n live rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qualification.tolerances import Margin, measure, tolerance
from reference import ops as ref_ops
from reference.op_types import (
    DraftRecord,
    FaultLog,
    RoundBegin,
    RoundState,
    SettleBounds,
    TargetRows,
)


@dataclass
class Finding:
    """The worst comparison of one (op, dtype, layer)."""

    op: str
    dtype: str
    layer: str
    round: int
    calls: int = 0
    used: float = 0.0  # share of the row's band; inf for a mismatch of an exact row
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.used <= 1.0

    def margin(self) -> str:
        """The gate's margin text when this is the worst finding."""
        share = ("exact" if self.used == 0.0 else "MISMATCH" if self.used == float("inf")
                 else f"{self.used:.0%} of row")
        return f"{share} ({self.op}[{self.dtype}], {self.layer})"


class LockstepFailure(AssertionError):
    """Raised by a strict Lockstep at the first comparison outside its row."""


def _labels(eng) -> dict[int, str]:
    """id of a weight object or cache → the name of its layer part."""
    w, names = eng.w, {}
    for layer in w.layers:
        tag = f"L{layer.index}"
        names[id(layer.attn.qkv)], names[id(layer.attn.o)] = f"{tag}.qkv", f"{tag}.o"
        if layer.dense is not None:
            for part in ("gate", "up", "down"):
                names[id(getattr(layer.dense, part))] = f"{tag}.{part}"
    names[id(w.draft.attn.qkv)], names[id(w.draft.attn.o)] = "draft.qkv", "draft.o"
    names[id(w.lm_head)], names[id(w.draft.lm_head)] = "lm_head", "draft.lm_head"
    names[id(w.draft.eh_proj)] = "draft.eh_proj"
    caches = eng.session.caches if getattr(eng, "session", None) is not None else None
    if caches is not None:
        for i, c in enumerate(caches.target):
            names[id(c)] = f"L{i}"
        names[id(caches.draft)] = "draft"
    return names


class Lockstep:
    """Replaces the engine's op table; every call is compared with its twin (module docstring).
    strict: raise LockstepFailure at the first comparison outside its row (for tests that want
    the failing call's traceback); else every comparison is recorded for the report."""

    def __init__(self, eng, strict: bool = False):
        from iquestrt.ops import TwinOps

        self.eng, self.strict = eng, strict
        self.k, self.t = eng.ops, TwinOps(eng.w.device, 1)
        self.findings: dict[tuple[str, str, str], Finding] = {}
        self.served, self.calls, self.round, self.compared = [], 0, 0, 0
        self.quantized: dict[str, int] = {}  # producer tail → GEMMs that took its quantization
        self.layer, self._names = "prefill", {}
        self.stopped = ""  # why the request ended early (an exception after a mismatch)
        eng.swap_ops(self)

    # --- bookkeeping -------------------------------------------------------------------------
    def _name(self, obj, fallback: str | None = None) -> str:
        if id(obj) not in self._names:
            self._names = _labels(self.eng)
        return self._names.get(id(obj), fallback or self.layer)

    def _part(self, obj) -> str:
        """The name of a weight's layer part (L3.qkv); the layer (L3) becomes the current one."""
        label = self._name(obj)
        self.layer = label.split(".")[0]
        return label

    def _record(self, op: str, dtype: str, used: float, detail: str, where: str | None) -> None:
        where = where or self.layer
        key = (op, dtype, where)
        f = self.findings.setdefault(key, Finding(op, dtype, where, self.round))
        f.calls += 1
        self.compared += 1
        if used > f.used or f.calls == 1:
            f.used, f.round, f.detail = max(used, f.used), self.round, detail
        if self.strict and used > 1.0:
            raise LockstepFailure(f"{op}[{dtype}] at {where}, round {self.round}: {detail}")

    def _cmp(self, got, want, op: str, dtype: str, where: str | None = None) -> None:
        tol = tolerance(op, dtype)
        got, want = got.cpu(), want.cpu()
        if tol.exact:
            same = torch.equal(got, want)
            bad = 0 if same else int((got != want).sum()) if got.shape == want.shape else -1
            self._record(op, dtype, 0.0 if same else float("inf"),
                         "exact" if same else f"not bit-exact: {bad} elements differ", where)
            return
        m: Margin = measure(got, want, tol)  # non-finite values: max_rel inf, band_used inf
        self._record(op, dtype, m.band_used, ("" if m.ok else "outside tolerance: ") + str(m),
                     where)

    def __getattr__(self, name):  # reset(), name, …
        return getattr(self.k, name)

    # --- dense and FP8 linears ---------------------------------------------------------------
    def linear_fp8(self, x, lin, live, out_dtype):
        where = self._part(lin)
        got, n = self.k.linear_fp8(x, lin, live, out_dtype), live.n
        dt = "bf16" if out_dtype == torch.bfloat16 else "fp32"
        self._cmp(got[:n], self.t.linear_fp8(x, lin, live, out_dtype)[:n], "kernels.linear_fp8",
                  dt, where)
        return got

    def _producer_quantization(self, x, xq, live, who: str) -> None:
        """A tail's quantization of its output must be reference quantize_act(x), bit for bit."""
        if xq is None:
            return
        n = live.n
        q, s = ref_ops.quantize_act(x[:n].cpu())
        self._cmp(xq[0][:n].view(torch.uint8), q.view(torch.uint8), "kernels.quantize_act",
                  "e4m3")
        self._cmp(xq[1][:n], s, "kernels.quantize_act", "fp32")
        self.quantized[who] = self.quantized.get(who, 0) + 1

    def linear_fp8_partials(self, x, lin, live, xq=None, out=None):
        where = self._part(lin)
        o_operand = xq is not None and xq is getattr(self, "o_quantized", None)
        self._producer_quantization(x, xq, live, "combine" if o_operand else "MoE")
        got = self.k.linear_fp8_partials(x, lin, live, xq=xq, out=out)
        self._check_partials(got, x, lin, live, where)
        return got

    def _check_partials(self, got, x, lin, live, where) -> None:
        """The kernel's split-K partials [S, R, N], summed in order, against the twin's GEMM."""
        n = live.n
        total = got[0, :n].clone()
        for s in range(1, got.shape[0]):
            total += got[s, :n]
        self._cmp(total, self.t.linear_fp8_partials(x, lin, live)[0, :n], "kernels.linear_fp8",
                  "fp32", where)

    def linear_bf16_f32(self, x, w, live, out_dtype):
        where = self._name(w, self.layer)
        got, n = self.k.linear_bf16_f32(x, w, live, out_dtype), live.n
        op = ("kernels.linear_bf16_f32", "fp32") if out_dtype == torch.float32 else (
            "kernels.linear_fp8", "bf16")  # that row covers linear_bf16_f32's bf16 output too
        self._cmp(got[:n], self.t.linear_bf16_f32(x, w, live, out_dtype)[:n], *op, where)
        return got

    # --- attention ---------------------------------------------------------------------------
    def qkv_rope(self, x, lin, q_norm, k_norm, positions, table, live, *, num_q_heads,
                 num_kv_heads, eps, xq=None, cache=None):
        """The kernel's partials against the twin's GEMM (kernels.linear_fp8's row); its q, k,
        v and cache against the twin's qk_rope on those same partials (exact)."""
        where = self._part(lin)
        self._producer_quantization(x, xq, live, "MoE")
        twin_cache = self._twin_cache(cache)
        heads = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, eps=eps)
        got = self.k.qkv_rope(x, lin, q_norm, k_norm, positions, table, live, xq=xq,
                              cache=cache, **heads)
        self._check_partials(got[0], x, lin, live, where)
        self._check_rope(got[1:], got[0], (q_norm, k_norm, positions, table, live), heads,
                         cache, twin_cache)
        return got

    def qk_rope(self, parts, *a, cache=None, **kw):
        """With a cache the kernel writes it, the twin a clone of it taken before: q, k, v and
        the cache's K, V and labels compared."""
        twin_cache = self._twin_cache(cache)
        got = self.k.qk_rope(parts, *a, cache=cache, **kw)
        self._check_rope(got, parts, a, kw, cache, twin_cache)
        return got

    def _twin_cache(self, cache):
        """A clone of the cache for the twin to write (None without a cache)."""
        if cache is None:
            return None
        self._part(cache)
        return cache.clone()

    def _check_rope(self, got, parts, a, kw, cache, twin_cache) -> None:
        """q, k, v (and the cache the kernel wrote) against the twin's qk_rope on `parts`."""
        want = self.t.qk_rope(parts, *a, cache=twin_cache, **kw)
        n = a[4].n
        for g, w in zip(got, want, strict=True):
            self._cmp(g[:n], w[:n], "kernels.qk_rope", "bf16")
        if cache is not None:
            self._same_cache(cache, twin_cache)

    def _same_cache(self, cache, twin_cache) -> None:
        for f in ("k", "v", "slot_pos"):
            self._cmp(getattr(cache, f), getattr(twin_cache, f), "kernels.kv_write", "bf16/int32")

    def _mutating(self, name, cache, *a):
        self._part(cache)
        twin_cache = cache.clone()
        getattr(self.k, name)(cache, *a)
        getattr(self.t, name)(twin_cache, *a)
        self._same_cache(cache, twin_cache)

    def rollback(self, cache, keep, written):
        self._mutating("rollback", cache, keep, written)

    def rollback_layers(self, caches, keep, written):
        """One kernel launch over every cache; the twin per cache on clones, each compared
        under its layer's name."""
        twins = [c.clone() for c in caches]
        self.k.rollback_layers(caches, keep, written)
        for cache, twin_cache in zip(caches, twins, strict=True):
            self._part(cache)
            self.t.rollback(twin_cache, keep, written)
            self._same_cache(cache, twin_cache)

    def attention_q(self, q, cache, positions, live, sink_k, scale):
        self._part(cache)
        got, oq = self.k.attention_q(q, cache, positions, live, sink_k, scale)
        want = self.t.attention(q, cache, positions, live, sink_k, scale)
        self._cmp(got[: live.n], want[: live.n], "kernels.attention", "bf16")
        if oq is not None:  # checked against quantize_act where the O projection takes it
            self.o_quantized = oq
        return got, oq

    def attention(self, q, cache, positions, live, sink_k, scale):
        self._part(cache)
        got = self.k.attention(q, cache, positions, live, sink_k, scale)
        want = self.t.attention(q, cache, positions, live, sink_k, scale)
        self._cmp(got[: live.n], want[: live.n], "kernels.attention", "bf16")
        return got

    # --- tails, rows, experts ----------------------------------------------------------------
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

    def draft_entry(self, src, live, norms, eh_out, pos_out):
        self.layer = "draft"
        got = self.k.draft_entry(src, live, norms, eh_out, pos_out)
        want = self.t.draft_entry(src, live, norms, eh_out.clone(), pos_out.clone())
        n = live.n
        self._cmp(got[0][:n], want[0][:n], "kernels.rows.norm", "bf16")
        self._cmp(got[1], want[1], "kernels.draft_entry.positions", "int32")
        return got

    def eh_proj(self, src, live, norms, w, pos):
        """Fused entry + projection == the kernel entry launch then the kernel linear, bit for
        bit (each of those compared with its twin as above)."""
        got = self.k.eh_proj(src, live, norms, w, pos)
        eh = torch.zeros(pos.shape[0], 2 * norms.embed.shape[1], dtype=torch.bfloat16,
                         device=pos.device)
        _, want_pos = self.draft_entry(src, live, norms, eh, pos.clone())
        want = self.linear_bf16_f32(eh, w, live, torch.bfloat16)
        self._cmp(got[0][: live.n], want[: live.n], "kernels.eh_proj.fused", "bf16")
        self._cmp(got[1], want_pos, "kernels.draft_entry.positions", "int32")
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

    # --- sampling ----------------------------------------------------------------------------
    def sample(self, logits, params, seed, positions, purpose, live):
        self.layer = "sampler"
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
        self.layer = "verify"
        got = self.k.verify(p, q_ids, q_probs, drafts, seed, first, n_drafts)
        want = self.t.verify(p, q_ids, q_probs, drafts, seed, first, n_drafts)
        for a, b in zip(got, want, strict=True):
            self._cmp(a.cpu(), b.cpu(), "kernels.verify", "int64")
        self.calls += 1
        self.round += 1
        return got

    # --- the round's bookkeeping ---------------------------------------------------------------
    def _same_record(self, got, want, row=("kernels.round_record", "int64/fp32")) -> None:
        """Bit for bit: floats as their bits, so moved NaN / garbage padding compares equal."""
        bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
        for g, w in zip(got, want, strict=True):
            if g.dtype in bits:
                g, w = g.view(bits[g.dtype]), w.view(bits[w.dtype])
            self._cmp(g, w, *row)

    _SCALARS = ("kernels.round_scalars", "int32/int64/fp32")

    def begin_round(self, s, rec, b, *, clear_from):
        """The kernel writes the round's own b and record, the twin clones taken before."""
        twin_rec = DraftRecord(*(t.clone() for t in rec))
        twin_b = RoundBegin(*(t.clone() for t in b))
        self.k.begin_round(s, rec, b, clear_from=clear_from)
        self.t.begin_round(s, twin_rec, twin_b, clear_from=clear_from)
        self._same_record((*b, *rec), (*twin_b, *twin_rec), self._SCALARS)

    def target_rows(self, s, rec, b, t):
        twin_t = TargetRows(*(x.clone() for x in t))
        self.k.target_rows(s, rec, b, t)
        self.t.target_rows(s, rec, b, twin_t)
        self._same_record(t, twin_t, self._SCALARS)

    def settle_bounds(self, v, s, t, go, out, *, recompute):
        twin_out = SettleBounds(*(x.clone() for x in out))
        self.k.settle_bounds(v, s, t, go, out, recompute=recompute)
        self.t.settle_bounds(v, s, t, go, twin_out, recompute=recompute)
        self._same_record(out, twin_out, self._SCALARS)

    def check_flags(self, flags, ran, log, *, code):
        twin_log = FaultLog(*(t.clone() for t in log))
        self.k.check_flags(flags, ran, log, code=code)
        self.t.check_flags(flags, ran, twin_log, code=code)
        self._same_record(log, twin_log)

    def check_logits(self, logits, live, log, *, code, where):
        """The kernel records into the round's log, the twin into a clone taken before."""
        twin_log = FaultLog(*(t.clone() for t in log))
        self.k.check_logits(logits, live, log, code=code, where=where)
        self.t.check_logits(logits, live, twin_log, code=code, where=where)
        self._same_record(log, twin_log)

    def record_draft(self, out, one, j, rec, log, *, vocab, code):
        twin_rec = DraftRecord(*(t.clone() for t in rec))
        twin_log = FaultLog(*(t.clone() for t in log))
        self.k.record_draft(out, one, j, rec, log, vocab=vocab, code=code)
        self.t.record_draft(out, one, j, twin_rec, twin_log, vocab=vocab, code=code)
        self._same_record((*rec, *log), (*twin_rec, *twin_log))

    def settle_round(self, v, keep_d, hidden, rec, s, *, vocab, code):
        twin_s = RoundState(*(t.clone() for t in s))
        self.k.settle_round(v, keep_d, hidden, rec, s, vocab=vocab, code=code)
        self.t.settle_round(v, keep_d, hidden, rec, twin_s, vocab=vocab, code=code)
        self._same_record(s, twin_s)

    # --- the verdict -------------------------------------------------------------------------
    def decode(self, req) -> int:
        """The engine's decode of req under the lockstep → the rounds it ran. A request that
        cannot go on after a recorded mismatch stops there (the reason kept in `stopped`)."""
        try:
            return len(self.eng.generate(req).rounds)
        except Exception as e:  # after a recorded mismatch the state may be past replaying
            if self.ok:
                raise
            self.stopped = (f"the request stopped after the first mismatch: "
                            f"{type(e).__name__}: {e}")
            return self.round

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings.values())

    def worst(self) -> list[Finding]:
        return sorted(self.findings.values(), key=lambda f: (-f.used, f.op, f.layer))

    def report(self, limit: int = 12) -> list[str]:
        """Failures first, then the largest shares of their rows: one line each."""
        lines = []
        for f in self.worst()[:limit]:
            share = ("MISMATCH" if f.used == float("inf") else "exact" if f.used == 0.0
                     else f"{f.used:.0%} of row")
            lines.append(f"{f.op}[{f.dtype}] {f.layer} round {f.round}: {share} "
                         f"({f.calls} calls){'' if f.ok else ' — ' + f.detail[:200]}")
        return lines


@dataclass(frozen=True)
class LockstepConfig:
    """CPU defaults: about a minute under the interpreter; on a GPU `gpu()` widens it."""

    prompt_tokens: int = 8
    new_tokens: int = 4
    shapes: tuple[tuple[int, int], ...] = ((4, 3),)  # (max width, fixed draft depth)
    seed: int = 2
    kind: str = "completion"

    @classmethod
    def gpu(cls) -> LockstepConfig:
        """Widths 4, 6, 8, each at its deepest draft (a round at depth d runs depths 1 … d, so
        width 8 depth 7 covers every depth), longer requests; the twins replay on the CPU."""
        return cls(prompt_tokens=24, new_tokens=16, shapes=((4, 3), (6, 5), (8, 7)))


@dataclass
class LockstepRun:
    width: int
    depth: int
    rounds: int
    lock: Lockstep = field(repr=False)


def _engine(ckpt, width: int, depth: int, device: str):
    from iquestrt.config import RuntimeConfig
    from iquestrt.engine import Engine
    from iquestrt.weights import from_checkpoint
    from reference.depth import FixedDepth

    # sync_rounds=1: no round runs after the request ends (those run every op with 0 live rows,
    # which the twins cannot replay; the scheduling gate covers them)
    rcfg = RuntimeConfig(ops="kernels", device=device, max_width=width, ring_pad=8,
                         max_positions=256, policy=FixedDepth(depth), sync_rounds=1)
    return Engine(from_checkpoint(ckpt, device, 256), rcfg)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    margin: str
    evidence: list[str]
    worst_used: float | None  # the largest share of a row; None when an exact row mismatched
    ops: frozenset[str] = frozenset()  # the tolerance rows that judged at least one call


def verdict(cfg: LockstepConfig | None = None) -> Verdict:
    from qualification import mini_engine
    from reference.speculative import GenerationRequest

    gpu = torch.cuda.is_available()
    cfg = cfg or (LockstepConfig.gpu() if gpu else LockstepConfig())
    ckpt = mini_engine.load_mini()
    (prompt,) = mini_engine.prompts(cfg.prompt_tokens, kinds=(cfg.kind,))
    req = GenerationRequest(prompt.ids, cfg.new_tokens, mini_engine.SAMPLING, cfg.seed)
    runs = []
    for width, depth in cfg.shapes:
        eng = _engine(ckpt, width, depth, "cuda" if gpu else "cpu")
        lock = Lockstep(eng)
        runs.append(LockstepRun(width, depth, lock.decode(req), lock))
    ok = all(r.lock.ok for r in runs)
    worst = max((f for r in runs for f in r.lock.findings.values()), key=lambda f: f.used)
    margin = worst.margin()
    ev = []
    for r in runs:
        lock = r.lock
        ev.append(f"width {r.width} depth {r.depth}: {lock.compared} comparisons over "
                  f"{lock.calls} sampler/verify calls, {r.rounds} rounds; "
                  f"{'all within their rows' if lock.ok else 'OUTSIDE their rows'}")
        ev += [f"  {line}" for line in lock.report(limit=6 if lock.ok else 12)]
        if lock.stopped:
            ev.append(f"  {lock.stopped[:300]}")
    ev.append(f"mini, {prompt.id}, last {cfg.prompt_tokens} tokens, {cfg.new_tokens} new, "
              f"{'compiled kernels' if gpu else 'kernels under the interpreter'}")
    used = None if worst.used == float("inf") else worst.used
    ops = frozenset(f.op for r in runs for f in r.lock.findings.values())
    return Verdict(ok, margin, ev, used, ops)


def run(cfg: LockstepConfig | None = None) -> tuple[bool, str, list[str]]:
    v = verdict(cfg)
    return v.ok, v.margin, v.evidence
