"""The decode engine (iquestrt/engine.py) with the "twins" ops on the CPU: equality with the
reference in Precision "matched", determinism, cache settlement, bad input and faults. The
"kernels" ops (Triton interpreter) are in test_engine_kernels.py.

Twins and Precision "matched" round at the same points in the same order and both compute one
row at a time, so they agree bit for bit (logits, tokens, drafts, q(token), entropies): any token
flip between them is a bug, not a near-tie, and fails with the reference's top-2 gap reported.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from iquestrt.config import RuntimeConfig, RuntimeConfigError
from iquestrt.engine import Engine, EngineError
from iquestrt.weights import from_checkpoint
from reference.checkpoint import CheckpointError, load_checkpoint, make_synthetic_checkpoint
from reference.config import SamplingDefaults
from reference.depth import FixedDepth
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, ReferenceGenerator, generate
from tests.helpers.engine_setup import (
    GREEDY,
    SAMPLING,
    cache_problems,
    make_ckpt,
    prefill,
    reference_held,
    rounds_key,
)

# A varied prompt: from 1, 2, …, 8 the correlated model's greedy stream settles on one repeated
# token after 31 tokens, from this one it keeps moving (123 distinct tokens in 256).
PROMPT = (5, 17, 300, 22, 9, 411, 78, 150)
PAD = 8  # tiny rings: target 16 + 8 slots, draft 8 + 8 slots
MINI = Path(__file__).resolve().parents[2] / "models" / "mini"  # the shipped trained model


@pytest.fixture(scope="module")
def corr(tmp_path_factory):
    return load_checkpoint(make_ckpt(tmp_path_factory.mktemp("corr"), "correlated"))


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return load_checkpoint(make_ckpt(tmp_path_factory.mktemp("synth"), "synthetic"))


def _fresh(ck):
    """A private copy for tests that poison weights (CPU weights alias the checkpoint's)."""
    return load_checkpoint(ck.directory)


def _engine(ck, **kw) -> Engine:
    kw.setdefault("ring_pad", PAD)
    kw.setdefault("policy", FixedDepth(3))
    rcfg = RuntimeConfig(ops="twins", max_positions=1024, **kw)
    return Engine(from_checkpoint(ck, "cpu", 1024), rcfg)


def _matched(ck, precision: str = "matched") -> ReferenceModel:
    return ReferenceModel(ck.cfg, ck.dequantized(), precision)


def _first_flip(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)


def _gap_report(model: ReferenceModel, prompt, tokens: list[int], i: int) -> str:
    """The reference's top-2 logit gap at the position of emitted token i."""
    seq = list(prompt) + tokens[:i]
    logits = model.target(torch.tensor(seq), torch.arange(len(seq))).logits[-1]
    top = torch.topk(logits, 2).values
    return f"token {i} (position {len(seq)}): reference top-2 gap {float(top[0] - top[1]):.4g}"


def _assert_same(res, want, model, prompt) -> None:
    flip = _first_flip(res.tokens, want.tokens)
    assert flip is None and len(res.tokens) == len(want.tokens), (
        "runtime (twins) and reference (matched) differ at "
        + (_gap_report(model, prompt, want.tokens, flip) if flip is not None else "the length")
    )
    assert rounds_key(res) == rounds_key(want)
    assert res.stop_reason == want.stop_reason


# --- (a) greedy: twins == matched reference ------------------------------------------------------


@pytest.mark.slow
def test_greedy_256_tokens_equal_matched_reference(corr):
    req = GenerationRequest(PROMPT, 256, GREEDY, 0)
    model = _matched(corr)
    res = _engine(corr).generate(req)
    want = generate(model, req, depth=3)
    _assert_same(res, want, model, PROMPT)
    acc = {r.accepted for r in res.rounds}
    assert {0, 3} <= acc and len(acc) >= 3, f"acceptance paths not exercised: {sorted(acc)}"


@pytest.mark.slow
def test_greedy_plain_synthetic_checkpoint_equals_matched_reference(synth):
    """The unedited synthetic checkpoint (its draft never agrees at temperature 0)."""
    req = GenerationRequest(PROMPT, 48, GREEDY, 0)
    model = _matched(synth)
    _assert_same(_engine(synth).generate(req), generate(model, req, depth=3), model, PROMPT)


@pytest.mark.slow
def test_forward_logits_equal_matched_reference_bit_for_bit(corr):
    tokens = list(range(40, 77))  # 37 positions: 5 chunks, both rings wrap
    eng, model = _engine(corr), _matched(corr)
    logits, hidden, caches = prefill(eng, tokens)
    out = model.target(torch.tensor(tokens), torch.arange(len(tokens)), model.new_target_cache())
    assert torch.equal(logits, out.logits) and torch.equal(hidden, out.hidden)
    d_logits, _ = eng.draft.forward(torch.tensor(tokens[1:9]), hidden[:8], 1, caches.draft)
    d_out = model.draft(torch.tensor(tokens[1:9]), out.hidden[:8], torch.arange(1, 9))
    assert torch.equal(d_logits[:8], d_out.logits)


@pytest.mark.slow
def test_matched_comparison_is_sensitive(corr):
    """Broken variants fail the checks above: the reference without the FP8 activation
    quantization (bf16-fold) — on logits and on tokens —, and a runtime whose rings hold
    exactly `window` slots."""
    tokens = list(range(40, 77))
    logits, _, _ = prefill(_engine(corr), tokens)
    fold = _matched(corr, "bf16-fold")
    out = fold.target(torch.tensor(tokens), torch.arange(len(tokens)), fold.new_target_cache())
    assert not torch.equal(logits, out.logits)
    req = GenerationRequest(PROMPT, 96, GREEDY, 0)
    res = _engine(corr).generate(req)
    assert _first_flip(res.tokens, generate(fold, req, depth=3).tokens) is not None
    eng = _engine(corr)
    object.__setattr__(eng.rcfg, "ring_pad", 0)  # bypasses RuntimeConfig's check on purpose
    with pytest.raises(ValueError, match="ring too small"):
        eng.generate(req)


# --- (c) sampling: fixed seed → identical tokens and acceptance ---------------------------------


@pytest.mark.slow
def test_sampling_is_deterministic_and_equals_matched_reference(corr):
    req = GenerationRequest(PROMPT, 64, SAMPLING, 11)
    runs = [_engine(corr).generate(req) for _ in range(2)]
    assert rounds_key(runs[0]) == rounds_key(runs[1]) and runs[0].tokens == runs[1].tokens
    exact_width = _engine(corr, max_width=4).generate(req)  # padded width 8 vs exact width 4
    assert rounds_key(exact_width) == rounds_key(runs[0])
    model = _matched(corr)
    _assert_same(runs[0], generate(model, req, depth=3), model, PROMPT)
    acc = {r.accepted for r in runs[0].rounds}
    assert acc == {0, 1, 2, 3}, f"acceptance paths not exercised: {sorted(acc)}"
    other = _engine(corr).generate(dataclasses.replace(req, seed=12))
    assert other.tokens != runs[0].tokens  # the seed is used


# --- (d) rollback: caches equal caches that never saw rejected rows -----------------------------


def _engine_snapshots(eng: Engine, req) -> list:
    snaps = []
    eng.generate(req, on_round=lambda rec: snaps.append(eng.session.caches.clone()))
    return snaps


def _reference_snapshots(model: ReferenceModel, req) -> list:
    """The reference generator's (target, draft) KVCaches after each round's settlement."""
    made = {}
    new_t, new_d = model.new_target_cache, model.new_draft_cache
    model.new_target_cache = lambda: made.setdefault("t", new_t())
    model.new_draft_cache = lambda: made.setdefault("d", new_d())
    snaps = []
    ReferenceGenerator(model, FixedDepth(3)).generate(
        req, on_round=lambda rec: snaps.append((made["t"].clone(), made["d"].clone())))
    return snaps


def _problems(ours, ref) -> list[str]:
    tc, dc = ref
    out = [f"committed {ours.target_len} vs {tc.next_position}, draft {ours.draft_next} vs "
           f"{dc.next_position}"] if (ours.target_len, ours.draft_next) != (
        tc.next_position, dc.next_position) else []
    for i, layer in enumerate(ours.target):
        out += [f"target layer {i}: {p}" for p in
                cache_problems(layer, ours.target_len, reference_held(tc, i))]
    return out + [f"draft: {p}" for p in
                  cache_problems(ours.draft, ours.draft_next, reference_held(dc, 0))]


@pytest.mark.slow
def test_rollback_leaves_caches_as_if_rejected_rows_never_came(corr):
    """After every round the runtime's caches (full caches and rings, K, V and labels) hold
    exactly the reference generator's rows — whose caches only ever truncate — across several
    wraps of every ring."""
    eng = _engine(corr)
    req = GenerationRequest(PROMPT, 96, SAMPLING, 5)
    ours, ref = _engine_snapshots(eng, req), _reference_snapshots(_matched(corr), req)
    assert len(ours) == len(ref)
    for i, (c, r) in enumerate(zip(ours, ref, strict=True)):
        assert _problems(c, r) == [], f"round {i}"
    rejected = sum(len(r.drafts) - r.accepted for r in eng.session.result.rounds)
    assert rejected >= 20
    assert ours[-1].target_len > 3 * eng.rcfg.target_ring_slots(eng.cfg)
    assert ours[-1].draft_next > 5 * eng.rcfg.draft_ring_slots(eng.cfg)


@pytest.mark.slow
def test_skipped_rollback_is_caught(corr, monkeypatch):
    """A control with nothing to catch proves nothing: the request must reject drafts (24
    tokens rejected none on the H200 host's torch 2.11 CPU:
    reports/benchmarks/h200-2026-12-01/session10/skipped_rollback.log; 96 reject ≥ 20 here)."""
    eng = _engine(corr)
    skipped = []  # the ops the round called and the mutant skipped
    monkeypatch.setattr(eng.ops, "rollback",
                        lambda cache, keep, written: skipped.append("rollback"))
    monkeypatch.setattr(eng.ops, "rollback_layers",
                        lambda caches, keep, written: skipped.append("rollback_layers"))
    req = GenerationRequest(PROMPT, 96, SAMPLING, 5)
    ours, ref = _engine_snapshots(eng, req), _reference_snapshots(_matched(corr), req)
    assert {"rollback", "rollback_layers"} <= set(skipped), "the mutant no longer reaches the round"
    rejected = sum(len(r.drafts) - r.accepted for r in eng.session.result.rounds)
    assert rejected > 0, "no draft was rejected: the skipped rollback had nothing to leave"
    problems = [p for c, r in zip(ours, ref, strict=True) for p in _problems(c, r)]
    assert any("uncommitted" in p for p in problems), problems


# --- (e) bad input: an error naming the problem, before any device work -------------------------


class _Counting:
    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        f = getattr(self.inner, name)

        def counted(*a, **k):
            self.calls.append(name)
            return f(*a, **k)

        return counted if callable(f) else f


def _bad(**kw) -> GenerationRequest:
    base = dict(prompt_ids=PROMPT, max_new_tokens=8, sampling=SAMPLING, seed=0)
    return GenerationRequest(**{**base, **kw})


BAD_REQUESTS = [
    (_bad(prompt_ids=()), "prompt_ids: the prompt must hold at least one token"),
    (_bad(prompt_ids=(1, 512)), r"prompt_ids: tokens \[512\] outside \[0, 512\)"),
    (_bad(max_new_tokens=0), "max_new_tokens: must be >= 1, got 0"),
    (_bad(max_new_tokens=-3), "max_new_tokens: must be >= 1, got -3"),
    (_bad(sampling=SamplingDefaults(-0.5, 20, 0.95)), "temperature: must be finite and >= 0"),
    (_bad(sampling=SamplingDefaults(math.nan, 20, 0.95)), "temperature"),
    (_bad(sampling=SamplingDefaults(1.0, 0, 0.95)), "top_k=0: the runtime's sampler serves"),
    (_bad(sampling=SamplingDefaults(1.0, 65, 0.95)), "top_k=65: the runtime's sampler serves"),
    (_bad(sampling=SamplingDefaults(1.0, 513, 0.95)), r"top_k: must be an integer in \[0"),
    (_bad(sampling=SamplingDefaults(1.0, 20, 0.0)), r"top_p: must be in \(0, 1\]"),
    (_bad(sampling=SamplingDefaults(1.0, 20, 1.5)), r"top_p: must be in \(0, 1\]"),
    (_bad(stop_ids=(3, 512)), r"stop_ids: tokens \[512\] outside"),
    (_bad(stop_ids=(-1,)), r"stop_ids: tokens \[-1\] outside"),
    (_bad(seed=-1), "seed: must be in"),
    (_bad(prompt_ids=(1,) * 1000, max_new_tokens=20), "exceed the runtime cache of 1024"),
    (_bad(max_new_tokens=4090), "exceeds max_position_embeddings=4096"),
]


@pytest.mark.parametrize("req, message", BAD_REQUESTS)
def test_bad_request_raises_before_device_work(corr, req, message):
    eng = _engine(corr)
    counting = _Counting(eng.ops)
    eng.swap_ops(counting)
    with pytest.raises(ValueError, match=message):
        eng.generate(req)
    assert counting.calls == [] and eng.session is None


def test_greedy_accepts_top_k_zero(corr):
    """top_k is ignored at temperature 0, so 0 (the reference's "off") is fine there."""
    assert len(_engine(corr).generate(_bad(sampling=GREEDY)).tokens) == 8


@pytest.mark.parametrize("kw, message", [
    (dict(ring_pad=6), r"ring_pad: must be in \[max_width - 1 = 7, 4096\]"),
    (dict(ring_pad=4097), r"ring_pad: must be in \[max_width - 1 = 7, 4096\]"),
    (dict(max_width=9), r"max_width: must be an int in \[1, 8\]"),
    (dict(ops="cuda"), "ops: choose one of"),
    (dict(max_width=4, policy=FixedDepth(4)), "draft depth 4 needs 5 verification rows"),
    (dict(max_polls=0), "max_polls"),
    (dict(device="gpu:zero"), "device: not a device"),
    (dict(loop="gpu"), r"loop: choose one of \('host', 'device'\)"),
    (dict(loop="device"), "loop: the device loop replays the round's CUDA graph"),
    (dict(wait_s=0), r"wait_s: must be a number of seconds in \(0, 86400\]"),
    (dict(graphs=True, device="cuda"), "graphs: CUDA graphs replay the compiled kernels"),
])
def test_bad_runtime_config(kw, message):
    with pytest.raises(RuntimeConfigError, match=message):
        RuntimeConfig(**kw)


def test_checkpoint_that_does_not_fit_the_runtime(corr, tmp_path):
    make_synthetic_checkpoint(tmp_path / "bf16", "tiny", 0, fmt="bf16")
    with pytest.raises(CheckpointError, match="format 'bf16'; the runtime serves E4M3"):
        from_checkpoint(load_checkpoint(tmp_path / "bf16"), "cpu")
    with pytest.raises(RuntimeConfigError, match="exceeds the model's max_position_embeddings"):
        Engine(from_checkpoint(corr, "cpu", 1024), RuntimeConfig(max_positions=8192))
    with pytest.raises(ValueError, match="RoPE tables cover 1024 positions"):
        Engine(from_checkpoint(corr, "cpu", 1024), RuntimeConfig(max_positions=2048))


# --- faults: the request ends with an error naming the round and layer --------------------------


def test_readiness_failure_names_the_layer(corr):
    eng = _engine(_fresh(corr))
    eng.w.layers[3].attn.o.s.fill_(float("nan"))  # o_proj partials of layer 3 turn NaN
    with pytest.raises(EngineError, match="prefill: readiness failure flag raised by target "
                                          "layer 3"):
        eng.generate(_bad())


def test_fault_in_a_later_round_names_the_round(corr):
    eng = _engine(_fresh(corr))

    def poison(rec):
        if len(eng.session.result.rounds) == 2:
            eng.w.layers[5].moe.proj_s.fill_(float("nan"))  # expert outputs of layer 5

    with pytest.raises(EngineError, match="round 2: readiness failure flag raised by target "
                                          "layer 5"):
        eng.generate(_bad(max_new_tokens=64), on_round=poison)


def test_non_finite_logits(corr):
    eng = _engine(_fresh(corr))
    eng.w.lm_head[7, 3] = float("inf")
    with pytest.raises(EngineError, match="prefill: non-finite logits from the final norm or "
                                          "lm_head"):
        eng.generate(_bad())
    eng = _engine(_fresh(corr))
    eng.w.draft.lm_head[7, 3] = float("inf")
    with pytest.raises(EngineError, match="prefill: non-finite logits from the draft layer"):
        eng.generate(_bad())  # the draft's prefill over the prompt meets it first
    with pytest.raises(EngineError, match="round 0 draft depth 0: non-finite logits from the "
                                          "draft layer"):
        eng.generate(_bad(prompt_ids=(5,)))  # no draft prefill: round 0's depth 0 does


def test_out_of_range_token(corr, monkeypatch):
    eng = _engine(corr)
    sample = eng.ops.sample

    def bad_sample(*a, **k):
        out = sample(*a, **k)
        out.tokens.fill_(512)
        return out

    monkeypatch.setattr(eng.ops, "sample", bad_sample)
    with pytest.raises(EngineError, match=r"prefill: token 512 outside \[0, 512\)"):
        eng.generate(_bad())


# --- CLI -----------------------------------------------------------------------------------------


def _cli_tokens(capsys, argv) -> list[int]:
    from iquestrt.cli import main

    capsys.readouterr()
    assert main(argv) == 0
    return [int(x) for x in capsys.readouterr().out.strip().splitlines()[0].split()]


@pytest.mark.slow
def test_cli_runtime_backend_equals_reference_matched(corr, capsys):
    base = ["generate", "--checkpoint", str(corr.directory), "--prompt-ids", "5,17,300",
            "--max-new-tokens", "12", "--seed", "2", "--draft-depth", "3", "--quiet"]
    runtime = _cli_tokens(capsys, base + ["--backend", "runtime", "--ops", "twins",
                                          "--ring-pad", "8"])
    matched = _cli_tokens(capsys, base + ["--backend", "reference", "--precision", "matched"])
    want = generate(_matched(corr), GenerationRequest((5, 17, 300), 12, corr.cfg.sampling, 2),
                    depth=3)
    assert runtime == matched == want.tokens


@pytest.mark.parametrize("extra, message", [
    (["--precision", "bf16"], "--precision: applies to backend 'reference' only"),
    (["--temperature", "1", "--top-k", "0"], "top_k=0: the runtime's sampler serves"),
    (["--ring-pad", "3"], "ring_pad: must be in [max_width - 1 = 7, 4096]"),
    (["--pdl"], "--pdl: programmatic dependent launch needs the compiled kernels on "
     "a GPU (ops twins"),
])
def test_cli_runtime_errors(corr, capsys, extra, message):
    from iquestrt.cli import main

    argv = ["generate", "--checkpoint", str(corr.directory), "--prompt-ids", "5,17",
            "--max-new-tokens", "4", "--backend", "runtime", "--ops", "twins", "--quiet"]
    capsys.readouterr()
    assert main(argv + extra) == 2
    assert message in capsys.readouterr().err


# --- adaptive draft depth -----------------------------------------------------------------------


@pytest.mark.slow
def test_adaptive_depth_runs_3_to_7_and_equals_the_reference():
    """The control step runs on the device (iquestrt/round.py); the reference decides on the host
    from DraftInfo. On the shipped mini model (the synthetic drafts serve q = 1), with the rule
    "another depth while the last draft's q ≥ 1/2": tokens, records and depths agree with the
    matched reference, every round runs 3 … 7 depths and several depths occur; a rule that
    always continues runs 7 (the decisions are used)."""
    from reference.depth import AdaptiveDepth

    ck = load_checkpoint(MINI)
    row = (0.0, 0.0, 1.0, 0.0, 0.0, 0.0)  # score = q of the last draft
    policy = AdaptiveDepth(weights=(row,) * 4, threshold=0.5)
    req = GenerationRequest((490, 290, 263, 434, 1085, 337), 40, SAMPLING, 21)
    res = _engine(ck, policy=policy).generate(req)
    ref = ReferenceGenerator(_matched(ck), policy).generate(req)
    depths = [len(r.drafts) for r in res.rounds]
    assert rounds_key(res) == rounds_key(ref) and res.tokens == ref.tokens
    assert min(depths) >= 3 and max(depths) <= 7 and len(set(depths)) > 1, depths
    always = AdaptiveDepth(weights=(row,) * 4, threshold=2.0**-20)
    assert {len(r.drafts) for r in _engine(ck, policy=always).generate(req).rounds} == {7}


@pytest.mark.slow
def test_streaming_delivers_every_token_once_and_can_cancel(corr):
    """on_tokens sees the request's tokens in order, each once, and the result equals a
    non-streaming run; returning False cancels: the request ends early with stop_reason
    "cancelled", the caches hold exactly the delivered tokens' positions."""
    req = GenerationRequest(PROMPT, 40, SAMPLING, 13)
    want = _engine(corr).generate(req)
    got: list[int] = []
    eng = _engine(corr)
    res = eng.generate(req, on_tokens=got.extend)
    assert got == res.tokens == want.tokens and rounds_key(res) == rounds_key(want)
    seen: list[int] = []

    def cancel_after_10(new):
        seen.extend(new)
        return len(seen) < 10

    res = eng.generate(req, on_tokens=cancel_after_10)
    assert res.stop_reason == "cancelled" and 10 <= len(res.tokens) < 40
    assert res.tokens == want.tokens[: len(res.tokens)] == seen
    assert eng.session.caches.target_len == len(PROMPT) + len(res.tokens) - 1


@pytest.mark.gpu
def test_twins_on_a_gpu_sync_every_round(corr):
    """The twins read live rows on the host and cannot run a round with none live, so on a GPU
    the loop reads every round as on the CPU (with sync_rounds 4 it launched rounds past the
    request's end and failed): a run nobody watches equals one watched round by round."""
    def run(watch: bool):
        rcfg = RuntimeConfig(ops="twins", device="cuda", ring_pad=PAD, max_positions=1024,
                             policy=FixedDepth(3), sync_rounds=4)
        eng = Engine(from_checkpoint(corr, "cuda", 1024), rcfg)
        res = eng.generate(GenerationRequest(PROMPT, 24, SAMPLING, 5),
                           on_round=(lambda rec: None) if watch else None)
        return res.tokens, rounds_key(res), res.stop_reason

    unwatched, watched = run(False), run(True)
    assert unwatched == watched
    assert len(unwatched[0]) == 24 and unwatched[2] == "length"


def test_twin_ops_write_a_callers_buffer(corr):
    """The kernels write partials / expert outputs into a caller's buffer (a TP ring slot); the
    twins give the same table: the values they return, copied into `out`, which they return."""
    from iquestrt.ops import Live, TwinOps

    w = from_checkpoint(corr, "cpu", 64)
    ops, live, layer = TwinOps(torch.device("cpu"), 4), Live.of(3, "cpu"), w.layers[1]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, layer.attn.o.w.shape[1], generator=g).bfloat16()
    want = ops.linear_fp8_partials(x, layer.attn.o, live)
    buf = torch.zeros_like(want)
    assert ops.linear_fp8_partials(x, layer.attn.o, live, out=buf) is buf
    assert torch.equal(buf.nan_to_num(7.0), want.nan_to_num(7.0))
    h = torch.randn(8, w.cfg.target.hidden_size, generator=g).bfloat16()
    k = layer.moe.top_k
    ids = torch.arange(8 * k).reshape(8, k) % w.cfg.target.num_experts
    wts = torch.full((8, k), 1.0 / k)
    want = ops.moe(h, wts, ids, layer.moe, live, torch.float32)
    out = torch.zeros_like(want)
    assert ops.moe(h, wts, ids, layer.moe, live, torch.float32, out=out) is out
    assert torch.equal(out[:3], want[:3])
