"""Gate 1 — the runtime against the reference on the same prompts and the same E4M3 weights.

The runtime (iquestrt.Engine: twins ops on the CPU, Triton kernels on a GPU) runs a plain
prefill through its decode path (chunks of ≤ 8 rows, as verification rounds do). Compared at the
logits of every position, two checks:
  1. vs the "matched" reference (the same quantization and rounding points, built from
     reference/ops.py). Twins: bit-exact (the `runtime.vs_matched` row). Kernels: within the
     matched band (qualification/matched_band.py): the matched reference taking the kernels'
     experts (a flipped near-tie must not smear over every later position), within m × its own
     variation under legal rounding-order noise on the prompt with 0, 1 and 8 tokens appended,
     + floor; every pinned expert difference must be a near-tie; the positions outside are
     listed. Top-k agreement (k = 20) and KL of the served distributions are reported.
  2. vs the FP32 reference: within a stability band (m × the error envelope of the "matched"
     reference — the FP8-activation design's own reference — under appending 1 and 8 tokens,
     + floor); the candidate's error never sets its own tolerance. On the kernels path a position
     outside the band passes only when the runtime chose other experts there and its first flip
     is a near-tie that the matched reference's own router variation explains (routing_flips:
     gap ≤ m · δ); every flip is listed. The BF16 envelope is the wrong
     yardstick here: E4M3 activations alone move the logits by ~3 % relative RMS against FP32 on
     the trained mini model (BF16: ~0.6 %), by ~30 % on the synthetic tiny model (BF16: ~4 %).
     This check alone is noise-limited (a missing sink used ~120 % of it on the H200); the
     matched check is the sharp one. What each detects: qualification/gate1_power.py.
Then teacher-forced passes at every verification width, and each layer's attention input vs the
FP32 reference (reported; the logits decide).

Model (RuntimeGateConfig.model): "mini" (default) — the shipped checkpoint models/mini and real
token sequences from its request sets (qualification/mini_engine.prompts, one per request kind);
"tiny" — a synthetic E4M3 tiny checkpoint and random tokens. Either way the prompt is longer
than the target's sliding ring (window + ring pad), so the rings wrap during the prefill.

Dimension letters: T prompt tokens, V vocabulary.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from qualification import matched_band, mini_engine, routing_flips, stability
from qualification.pinned_routes import KVRecorder
from qualification.tolerances import measure, tolerance
from reference.checkpoint import load_checkpoint, make_synthetic_checkpoint
from reference.config import SamplingDefaults
from reference.model import ReferenceModel
from reference.sampling import served_distribution

MODELS = ("mini", "tiny")
RING_PAD = 8  # ring slots beyond the window: the smallest legal pad at width 8, rings wrap early
APPENDS = 8  # tokens beyond `length` each prompt carries: the stability band's largest append
FLIP_FLOOR = 0.0  # router-logit slack of a legal flip beyond m·δ (routing_flips): none


@dataclass(frozen=True)
class RuntimeGateConfig:
    model: str = "mini"
    prompts: int = 2  # mini: at most one per request kind (3)
    length: int = 160  # > the mini target ring (128 + 8 slots): rings wrap during the prefill
    seed: int = 13  # tiny: random prompts; both: nothing else
    top_k: int = 20

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"RuntimeGateConfig.model: choose one of {MODELS}, got {self.model!r}")
        if not 1 <= self.prompts <= 3:
            raise ValueError(f"RuntimeGateConfig.prompts: must be in [1, 3], got {self.prompts}")


TINY = RuntimeGateConfig(model="tiny", length=40)  # > the tiny target ring (16 + 8 slots)


@dataclass(frozen=True)
class RuntimeSetup:
    engines: dict[int, object]  # max_width → iquestrt Engine on the same weights
    refs: dict[str, ReferenceModel]  # "fp32", "matched" on the dequantized weights
    prompts: tuple[torch.Tensor, ...]  # [length + APPENDS] each: g.prompts judged, then one more

    @property
    def engine(self):
        return self.engines[max(self.engines)]

    def router_weights(self) -> dict[int, torch.Tensor]:  # {layer: [E, H]} of the MoE layers
        p = self.refs["matched"].p
        return {i: p[f"model.layers.{i}.mlp.router.weight"] for i in range(
            self.refs["matched"].cfg.target.num_hidden_layers)
            if f"model.layers.{i}.mlp.router.weight" in p}

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:  # [T] → [T, V] FP32 on the CPU
        return self.engine.prefill_logits(tokens.tolist())[0].cpu()


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per row over p's support, float64; inf where q misses p's support."""
    p, q = p.double(), q.double()
    terms = torch.where(p > 0, p * (p.log() - q.clamp_min(1e-300).log()), torch.zeros_like(p))
    missing = ((p > 0) & (q == 0)).any(-1)
    return torch.where(missing, torch.full_like(terms[:, 0], float("inf")), terms.sum(-1))


WIDTHS = (4, 6, 8)  # verification widths of the teacher-forced passes


def _per_layer(engine, ref, tokens: list[int]) -> list[tuple[int, float, float, int]]:
    """Each layer's attention input xn, runtime (teacher-forced prefill in chunks of its width)
    vs the FP32 reference: (layer, max rel, rms rel, worst position)."""
    engine.target.layer_trace, ref.layer_trace = [], []
    try:
        engine.prefill_logits(tokens)
        ref.target(torch.tensor(tokens), torch.arange(len(tokens)), None)
        got: dict[int, list[torch.Tensor]] = {}
        for i, x in engine.target.layer_trace:
            got.setdefault(i, []).append(x)
        want = dict(ref.layer_trace)
    finally:
        engine.target.layer_trace = ref.layer_trace = None
    out = []
    for i in sorted(want):
        a, b = torch.cat(got[i]).double(), want[i].double()
        d = (a - b).abs()
        out.append((i, float(d.max() / b.abs().max()), float(d.norm() / b.norm()),
                    int(d.max(-1).values.argmax())))
    return out


def _widths_and_layers(setup: RuntimeSetup, toks: torch.Tensor, ops, ok, evidence):
    """Teacher-forced passes at every verification width (bit-exact vs matched for the twins),
    then the per-layer comparison with the FP32 reference (reported; the logits decide)."""
    refs, engines, engine = setup.refs, setup.engines, setup.engine
    want = refs["matched"].target(toks, torch.arange(len(toks)), None).logits
    for w in WIDTHS:
        got = engines[w].prefill_logits(toks.tolist())[0].cpu()
        if ops == "twins":
            same = torch.equal(got, want)
            ok &= same
            evidence.append(f"teacher-forced width {w}: {'bit-exact' if same else 'NOT bit-exact'}"
                            " vs matched")
        else:
            evidence.append(f"teacher-forced width {w}: max |Δlogit| vs matched "
                            f"{float((got - want).abs().max()):.3e} (reported)")
    layers = _per_layer(engine, refs["fp32"], toks.tolist())
    worst = max(layers, key=lambda r: r[2])
    evidence.append("per layer vs FP32 (attention input xn, rms rel): " + ", ".join(
        f"L{i} {rms:.2e}" for i, _, rms, _ in layers))
    evidence.append(f"worst layer {worst[0]}: rms rel {worst[2]:.2e}, max rel {worst[1]:.2e} at "
                    f"position {worst[3]}")
    return ok, evidence


def _tiny_setup(g: RuntimeGateConfig, rcfg) -> tuple:
    from iquestrt.engine import Engine

    with tempfile.TemporaryDirectory() as tmp:
        ckpt_dir = Path(tmp) / "tiny"
        make_synthetic_checkpoint(ckpt_dir, "tiny", 0, fmt="fp8")
        ckpt = load_checkpoint(ckpt_dir)
        engines = {w: Engine.from_checkpoint(ckpt_dir, replace(rcfg, max_width=w))
                   for w in WIDTHS}
    gen = torch.Generator().manual_seed(g.seed)
    # judged prompts first, then the widths prompt (its own generator, seed + 7)
    judged = [torch.randint(0, ckpt.cfg.target.vocab_size, (g.length + APPENDS,), generator=gen)
              for _ in range(g.prompts)]
    gen7 = torch.Generator().manual_seed(g.seed + 7)
    last = torch.randint(0, ckpt.cfg.target.vocab_size, (g.length + APPENDS,), generator=gen7)
    return engines, ckpt, (*judged, last)


def _mini_setup(g: RuntimeGateConfig, rcfg) -> tuple:
    from iquestrt.config import KERNEL_WIDTH
    from iquestrt.engine import Engine
    from iquestrt.weights import from_checkpoint

    ckpt = mini_engine.load_mini()
    cap = g.length + APPENDS + KERNEL_WIDTH  # RoPE tables: the longest prefill and its caches
    weights = from_checkpoint(ckpt, rcfg.device, cap)
    engines = {w: Engine(weights, replace(rcfg, max_width=w, max_positions=cap)) for w in WIDTHS}
    kinds = [torch.tensor(p.ids) for p in mini_engine.prompts(g.length + APPENDS)]
    # judged prompts first (one per kind), then the widths prompt: the last kind
    return engines, ckpt, (*kinds[: g.prompts], kinds[-1])


def setup(g: RuntimeGateConfig, ops: str) -> RuntimeSetup:
    """Engines at every width in WIDTHS and the references, on g.model's E4M3 weights."""
    from iquestrt.config import RuntimeConfig

    gpu = torch.cuda.is_available()
    # the twins run on the CPU everywhere: their bits equal the CPU "matched" reference's
    dev = "cuda" if gpu and ops == "kernels" else "cpu"
    rcfg = RuntimeConfig(ops=ops, device=dev, ring_pad=RING_PAD, prefetch=False)
    build = _mini_setup if g.model == "mini" else _tiny_setup
    engines, ckpt, prompts = build(g, rcfg)
    t = ckpt.cfg.target
    if g.length <= t.sliding_window + RING_PAD:
        raise ValueError(f"RuntimeGateConfig.length: {g.length} tokens do not wrap the {g.model} "
                         f"target ring ({t.sliding_window} + {RING_PAD} slots)")
    params = ckpt.dequantized()
    refs = {p: ReferenceModel(ckpt.cfg, params, p) for p in ("fp32", "matched")}
    return RuntimeSetup(engines, refs, prompts)


def band_config(g: RuntimeGateConfig) -> stability.StabilityConfig:
    """Check 2's FP32 stability band for one prompt of g.length tokens."""
    return stability.StabilityConfig(prompts=1, length=g.length, appends=(1, APPENDS))


@dataclass
class PromptVerdict:
    matched_ok: bool  # check 1: twins bit-exact, kernels within the matched band
    fp32_ok: bool  # check 2: within the FP32 stability band (flips excused by near-ties)
    fp32_share: float  # worst share of the FP32 stability band
    matched_share: float | None  # kernels: worst share of the matched band; twins: None
    evidence: list[str]

    @property
    def ok(self) -> bool:
        return self.matched_ok and self.fp32_ok


class PromptRefs:
    """The candidate-independent parts of one prompt's checks, computed once (qualify judges one
    candidate; gate1_power judges many on the same prompts)."""

    def __init__(self, s: RuntimeSetup, g: RuntimeGateConfig, full: torch.Tensor):
        self.full, T = full, g.length
        # one traced forward over all T + APPENDS tokens gives the matched logits and routes of
        # the judged T (the matched reference computes row at a time: later rows change no bit)
        # and the stability band's longest append
        routes, logits = routing_flips.reference_routes(s.refs["matched"], full, with_logits=True)
        self.matched_routes = {i: (x[:T], ids[:T]) for i, (x, ids) in routes.items()}
        self.want = logits[:T]  # [T, V]
        self.stability: dict = {}  # stability.per_position's memo
        stability.remember_matched(self.stability, s.refs["fp32"], s.refs["matched"],
                                   band_config(g), full, logits)
        self._fp32_routes: dict | None = None
        self._band: matched_band.BandReference | None = None
        self._s, self._g = s, g

    def routes(self) -> tuple[dict, dict]:  # (matched, fp32) reference routes of the prompt
        if self._fp32_routes is None:
            self._fp32_routes = routing_flips.reference_routes(self._s.refs["fp32"],
                                                               self.full[: self._g.length])
        return self.matched_routes, self._fp32_routes

    def band(self) -> matched_band.BandReference:
        if self._band is None:
            self._band = matched_band.BandReference(self._s.refs["matched"], *self.routes(),
                                                    self.full)
        return self._band


@dataclass
class Candidate:
    logits: torch.Tensor  # [T, V] FP32 on the CPU
    routes: dict | None  # kernels: {layer: ids [T, K]} its routers chose
    kv: dict | None  # kernels: {layer: (K, V) [T, Hkv, D]} it wrote


def candidate(s: RuntimeSetup, tokens: torch.Tensor, traced: bool) -> Candidate:
    """The runtime's prefill of tokens [T]; traced: with its routes and K/V (the matched band's
    inputs; the kernels path)."""
    if not traced:
        return Candidate(s.logits(tokens), None, None)
    eng = s.engine
    real = eng.target.ops
    rec = eng.target.ops = KVRecorder(real)
    try:
        routes, got, caches = routing_flips.runtime_routes(eng, tokens.tolist())
    finally:
        eng.target.ops = real
    return Candidate(got, routes, rec.kv(caches))


def judge_prompt(s: RuntimeSetup, g: RuntimeGateConfig, ops: str, i: int, pr: PromptRefs,
                 cand: Candidate) -> PromptVerdict:
    """Prompt i's two checks (module docstring) on the candidate's prefill."""
    got, routes = cand.logits, cand.routes
    want, served = pr.want, SamplingDefaults(1.0, g.top_k, 0.95)
    band_cfg = band_config(g)
    evidence, matched_share, flips = [], None, None
    if ops == "twins":
        matched_ok = torch.equal(got, want)
        diff = "bit-exact" if matched_ok else (
            f"NOT bit-exact: {measure(got, want, tolerance('runtime.vs_matched', ops))}")
    else:
        err = (got - want).abs()
        pos = int(err.max(-1).values.argmax())
        diff = f"max |Δlogit| {float(err.max()):.3e} at position {pos} (unpinned, reported)"

        def flips(_t, routes=routes):
            m_routes, f_routes = pr.routes()
            return routing_flips.find(routes, m_routes, f_routes, s.router_weights(),
                                      band_cfg.multiple, FLIP_FLOOR)

        mb = matched_band.run(pr.band(), got, routes, cand.kv)
        matched_ok, matched_share = mb.ok, mb.worst
        evidence += [f"prompt {i} matched band: {'pass' if mb.ok else 'FAIL'}: " + e
                     for e in mb.evidence]
    topk_got = got.topk(g.top_k, dim=-1).indices.sort(-1).values
    topk_want = want.topk(g.top_k, dim=-1).indices.sort(-1).values
    agree = (topk_got == topk_want).all(-1).float().mean().item()
    kl = _kl(served_distribution(want, served), served_distribution(got, served))
    evidence.append(
        f"prompt {i} ({ops}, {g.model}) vs matched: {diff}; top-{g.top_k} sets equal at "
        f"{agree:.0%} of positions; max KL(served) {float(kl.max()):.2e} at position "
        f"{int(kl.argmax())}"
    )
    s_ok, s_worst, s_ev = stability.run(s.refs["fp32"], s.refs["matched"], lambda _t: got,
                                        band_cfg, [pr.full], flips, pr.stability)
    evidence += [f"prompt {i} vs FP32 within the stability band: " + e for e in s_ev]
    return PromptVerdict(matched_ok, s_ok, s_worst, matched_share, evidence)


def run(g: RuntimeGateConfig | None = None, ops: str | None = None):
    """(ok, margin text, evidence)."""
    g = g or RuntimeGateConfig()
    ops = ops or ("kernels" if torch.cuda.is_available() else "twins")
    s = setup(g, ops)
    verdicts = []
    for i, full in enumerate(s.prompts[: g.prompts]):
        verdicts.append(judge_prompt(s, g, ops, i, PromptRefs(s, g, full),
                                     candidate(s, full[: g.length], ops == "kernels")))
    ok = all(v.ok for v in verdicts)
    evidence = [e for v in verdicts for e in v.evidence]
    ok, evidence = _widths_and_layers(s, s.prompts[-1][: g.length], ops, ok, evidence)
    fp32 = max(v.fp32_share for v in verdicts)
    if ops == "twins":
        exact = all(v.matched_ok for v in verdicts)
        margin = ("bit-exact vs matched" if exact else "NOT bit-exact vs matched") + (
            f"; {fp32:.0%} of the FP32 band")
    else:
        matched = max(v.matched_share for v in verdicts)
        margin = f"{matched:.0%} of the matched band; {fp32:.0%} of the FP32 band"
    return ok, margin, evidence
