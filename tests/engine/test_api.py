"""The Python API (iquestrt/api.py) on the shipped mini model, twins engine on the CPU."""

from __future__ import annotations

import pytest

from iquestrt import LLM, EngineOptions, SamplingParams, SpecDecodeStats
from iquestrt.api import TextStream
from iquestrt.engine import EngineError
from qualification import mini_engine
from reference.checkpoint import load_checkpoint
from reference.depth import FixedDepth
from reference.model import ReferenceModel
from reference.speculative import (
    GenerationRequest,
    GenerationResult,
    ReferenceGenerator,
    RoundRecord,
)

PROMPT = "def add(a, b):\n    "
PARAMS = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, max_tokens=20, seed=3)


@pytest.fixture(scope="module")
def llm():
    return LLM(mini_engine.MINI, ops="twins", draft_depth=3, max_model_len=256)


@pytest.mark.slow
def test_generate_equals_the_matched_reference(llm):
    """The engine's twins equal the matched reference bit for bit (gate 3b), so the API's tokens
    must be the reference generator's on the same request; text is their decoding."""
    out = llm.generate(PROMPT, PARAMS)
    ckpt = load_checkpoint(mini_engine.MINI)
    model = ReferenceModel(ckpt.cfg, ckpt.dequantized(), precision="matched")
    ids = tuple(llm.tokenizer.encode(PROMPT).ids)
    want = ReferenceGenerator(model, FixedDepth(3)).generate(
        GenerationRequest(ids, 20, ckpt.cfg.sampling, 3))
    assert out.prompt_token_ids == ids
    assert list(out.token_ids) == want.tokens
    assert out.text == llm.tokenizer.decode(want.tokens)
    assert out.finish_reason == "length"
    drafts = [r for r in want.rounds if r.drafts]
    assert out.spec.num_drafts == len(drafts)
    assert out.spec.num_accepted_tokens == sum(r.accepted for r in drafts)
    t = out.timing
    assert t.rounds == len(want.rounds) and t.output_tokens == 20
    assert t.prefill_s > 0 and t.decode_s > 0 and not t.captured  # no graphs on a CPU
    assert t.time_per_output_token_s == pytest.approx(t.decode_s / 19)


@pytest.mark.slow
def test_stream_equals_generate_and_cancel_frees_the_engine(llm):
    out = llm.generate(PROMPT, PARAMS)
    with llm.stream(PROMPT, PARAMS) as s:
        deltas = list(s)
    assert "".join(deltas) == out.text and s.output.token_ids == out.token_ids
    assert len(deltas) > 3  # a delta per round, not one at the end
    long = SamplingParams(max_tokens=200, seed=3)
    with llm.stream(PROMPT, long) as s:
        for i, _ in enumerate(s):
            if i == 1:
                s.cancel()
    assert s.output.finish_reason == "cancelled"
    assert 2 <= len(s.output.token_ids) < 200
    again = llm.generate(PROMPT, PARAMS)  # served at once, as if nothing had been cancelled
    assert again.token_ids == out.token_ids


def test_leaving_a_stream_early_cancels_it(llm):
    s = llm.stream(PROMPT, SamplingParams(max_tokens=200, seed=1))
    next(s)
    assert s.close().finish_reason == "cancelled"


def test_a_failing_request_raises_in_the_iterating_thread(llm, monkeypatch):
    def broken(req, on_tokens):
        on_tokens([1])
        raise EngineError("round 0: readiness failure flag raised by target layer 2")

    monkeypatch.setattr(llm.backend, "generate", broken)
    with pytest.raises(EngineError, match="readiness failure"), llm.stream([1, 2], PARAMS) as s:
        list(s)


@pytest.mark.slow
def test_a_failure_binding_the_workers_device_reaches_the_caller(llm, monkeypatch):
    """The worker thread's first step (binding the CUDA device) failed outside the handler once
    (a "cuda" device without an index): the thread died and the iterator waited for tokens."""
    def unbound(self):
        raise ValueError("Expected a torch.device with a specified index")

    monkeypatch.setattr(TextStream, "_bind_device", unbound)
    with pytest.raises(ValueError, match="specified index"), llm.stream([1, 2], PARAMS) as s:
        list(s)
    monkeypatch.undo()
    assert llm.generate([1, 2], PARAMS).token_ids  # the engine was left free


@pytest.mark.gpu
def test_stream_on_the_gpu_kernels_equals_generate():
    """On a GPU the stream's worker thread runs the compiled kernels, with and without graphs:
    the same tokens as generate, deltas as they come, cancellation."""
    for graphs in (False, True):
        gpu = LLM(mini_engine.MINI, ops="kernels", graphs=graphs, draft_depth=3,
                  max_model_len=512)
        out = gpu.generate(PROMPT, SamplingParams(max_tokens=120, seed=3))
        with gpu.stream(PROMPT, SamplingParams(max_tokens=120, seed=3)) as s:
            deltas = list(s)
        assert "".join(deltas) == out.text and s.output.token_ids == out.token_ids
        assert len(deltas) > 2
        with gpu.stream(PROMPT, SamplingParams(max_tokens=400, seed=3)) as s:
            next(s)
            s.cancel()
            list(s)
        assert s.output.finish_reason == "cancelled" and len(s.output.token_ids) < 400
        gpu.close()


@pytest.mark.parametrize("kw, message", [
    ({"max_tokens": 0}, "SamplingParams.max_tokens: must be >= 1, got 0"),
    ({"max_tokens": True}, "SamplingParams.max_tokens: expected int, got bool"),
    ({"max_tokens": "8"}, "SamplingParams.max_tokens: expected int, got str"),
    ({"seed": 2**64}, "SamplingParams.seed: must be in [0, 2^64)"),
    ({"temperature": "hot"}, "SamplingParams.temperature: expected int or float, got str"),
    ({"stop_token_ids": (1, 2.5)}, "SamplingParams.stop_token_ids: expected int, got float"),
])
def test_bad_sampling_params_name_the_field(kw, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert message in str(e.value)


@pytest.mark.parametrize("prompt, kw, message", [
    (PROMPT, {"top_p": 1.5}, "sampling.top_p: must be in (0, 1], got 1.5"),
    ([1, 2, 10**9], {}, "prompt_ids: tokens [1000000000] outside [0, "),
    ([1] * 250, {"max_tokens": 10}, "prompt (250 tokens) + SamplingParams.max_tokens (10) = 260 "
     "exceeds EngineOptions.max_model_len 256"),
    ("", {}, "prompt: empty"),
    ([1, "2"], {}, "prompt: expected text or a sequence of integer token ids"),
])
def test_bad_requests_are_refused_before_running(llm, prompt, kw, message):
    with pytest.raises(ValueError) as e:
        llm.stream(prompt, SamplingParams(**kw))
    assert message in str(e.value)


@pytest.mark.parametrize("kw, message", [
    ({"backend": "vllm"}, "EngineOptions.backend: 'vllm'"),
    ({"backend": "reference", "graphs": True}, "EngineOptions.graphs: applies to backend "
     "'runtime' only"),
    ({"precision": "fp32"}, "EngineOptions.precision: applies to backend 'reference' only"),
    ({"backend": "reference", "pdl": True}, "EngineOptions.pdl: applies to backend 'runtime' "
     "only"),
    ({"max_model_len": 1}, "EngineOptions.max_model_len: must be an integer >= 2, got 1"),
])
def test_bad_engine_options_name_the_field(kw, message):
    with pytest.raises(ValueError) as e:
        EngineOptions(**kw)
    assert message in str(e.value)


def test_spec_stats_follow_vllms_definitions():
    rounds = [RoundRecord(5, [None] * 3, 3, [1, 2, 3, 4], True),  # all 3 accepted + bonus
              RoundRecord(9, [None] * 3, 1, [5, 6], False),  # 1 accepted + replacement
              RoundRecord(11, [], 0, [7], False)]  # no draft: not a draft round
    s = SpecDecodeStats.of(GenerationResult(tokens=[0, 1, 2, 3, 4, 5, 6, 7], rounds=rounds))
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 6, 4)
    assert s.accepted_per_position == (2, 1, 1)
    assert s.mean_acceptance_length == 3.0  # 1 + 4 / 2
    assert s.acceptance_rate_per_position() == (1.0, 0.5, 0.5)
    assert s.draft_acceptance_rate == pytest.approx(4 / 6)


@pytest.mark.slow
def test_the_reference_backend_serves_the_same_api():
    llm = LLM(mini_engine.MINI, backend="reference", precision="matched", draft_depth=3)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, seed=3))
    twins = LLM(mini_engine.MINI, ops="twins", draft_depth=3, max_model_len=64)
    assert out.token_ids == twins.generate(PROMPT, SamplingParams(max_tokens=6, seed=3)).token_ids


def test_graphs_default_follows_the_ops(monkeypatch):
    """EngineOptions.graphs None turns graphs on only for the compiled kernels on a GPU: the
    twins read device values on the host, which no captured graph can (a twins server on a
    GPU with graphs on answers every request with 500)."""
    import iquestrt.engine_options as eo

    monkeypatch.setattr(eo.torch.cuda, "is_available", lambda: True)
    seen = {}

    class Stop(Exception):
        pass

    def capture(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr("iquestrt.config.RuntimeConfig", capture)
    from iquestrt import assets
    from reference.checkpoint import load_checkpoint

    ck = load_checkpoint(assets.default_model())
    for ops, graphs in (("twins", False), ("kernels", True)):
        with pytest.raises(Stop):
            eo.RuntimeBackend(ck, eo.EngineOptions(ops=ops), None)
        assert seen["graphs"] is graphs, ops
