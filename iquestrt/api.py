"""The Python API, in the shape vLLM users know: `LLM` loads a checkpoint once and serves one
request at a time (a single-request runtime); `SamplingParams` describes a request.

    from iquestrt import LLM, SamplingParams
    llm = LLM("models/mini")
    out = llm.generate("def add(a, b):", SamplingParams(max_tokens=64, seed=0))
    out.text, out.token_ids, out.finish_reason, out.spec.mean_acceptance_length, out.timing
    with llm.stream("def add(a, b):", SamplingParams(max_tokens=64)) as s:
        for delta in s:          # text deltas; s.cancel() (or leaving the block) stops it
            print(delta, end="")
    s.output                     # the RequestOutput, finish_reason "cancelled" if cancelled

A stream's engine runs in a worker thread and hands over tokens at every read of its device log
(about every 32 tokens on a GPU, every round on a CPU); a cancel takes effect at the next read.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from iquestrt import assets
from iquestrt.engine_options import EngineOptions, build_backend
from iquestrt.files import checkpoint_tokenizer
from reference.checkpoint import load_checkpoint
from reference.speculative import GenerationRequest, GenerationResult


@dataclass(frozen=True)
class SamplingParams:
    """None takes the checkpoint's default (config.json's sampling block). Stops: a request
    ends at any of stop_token_ids, or — unless ignore_eos — at the checkpoint's end-of-sequence
    ids. The seed keys every draw (with position and purpose): same seed → same tokens."""

    temperature: float | None = None  # 0 = greedy
    top_k: int | None = None  # 0 = off (reference backend only); runtime: 1 … 64 unless greedy
    top_p: float | None = None  # 1.0 = off
    max_tokens: int = 16
    seed: int = 0  # [0, 2^64): the 64-bit Philox key, every bit used by both backends
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _typed("max_tokens", self.max_tokens, int)
        _typed("seed", self.seed, int)
        _typed("ignore_eos", self.ignore_eos, bool)
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if v is not None:
                _typed(name, v, (int, float))
        if self.top_k is not None:
            _typed("top_k", self.top_k, int)
        _typed("stop_token_ids", self.stop_token_ids, (list, tuple))
        ids = tuple(self.stop_token_ids)
        for i in ids:
            _typed("stop_token_ids", i, int)
        object.__setattr__(self, "stop_token_ids", ids)
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens: must be >= 1, got {self.max_tokens}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"SamplingParams.seed: must be in [0, 2^64), got {self.seed}")


def _typed(name: str, value, types) -> None:
    wrong_bool = isinstance(value, bool) and bool not in _as_tuple(types)  # bool is an int
    if wrong_bool or not isinstance(value, types):
        raise ValueError(f"SamplingParams.{name}: expected {_type_name(types)}, got "
                         f"{type(value).__name__} ({value!r})")


def _as_tuple(t) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _type_name(types) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(types))


@dataclass(frozen=True)
class SpecDecodeStats:
    """One request's speculative-decoding counters, defined as vLLM's: a draft is a
    verification round that drafted at least one token; mean_acceptance_length = 1 +
    accepted tokens / drafts (the tokens a round yields when nothing trims it: the accepted
    drafts and the target's own token). accepted_per_position[j]: drafts whose token j + 1 was
    accepted. Tokens trimmed by the budget or a stop id still count as accepted here."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def acceptance_rate_per_position(self) -> tuple[float, ...]:
        """[j]: P(draft token j + 1 accepted) over all drafts (vLLM's per-position rate)."""
        n = self.num_drafts
        return tuple(a / n for a in self.accepted_per_position) if n else ()

    @classmethod
    def of(cls, res: GenerationResult) -> SpecDecodeStats:
        drafted = [r for r in res.rounds if r.drafts]
        depth = max((len(r.drafts) for r in drafted), default=0)
        per = [sum(1 for r in drafted if r.accepted > j) for j in range(depth)]
        return cls(len(drafted), sum(len(r.drafts) for r in drafted),
                   sum(r.accepted for r in drafted), tuple(per))


@dataclass(frozen=True)
class RequestTiming:
    """Wall seconds of one request, phase by phase (reference.speculative.Timing): prefill (to
    the first token, on the host), set-up (device state, graph capture when `captured`), the
    decode clock. time_per_output_token_s = decode / the tokens after the first; the first
    request of an engine also pays Triton's compilation inside prefill and set-up."""

    prefill_s: float
    setup_s: float
    decode_s: float
    captured: bool
    rounds: int
    output_tokens: int

    @property
    def time_per_output_token_s(self) -> float | None:
        return self.decode_s / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def tokens_per_round(self) -> float | None:
        return (self.output_tokens - 1) / self.rounds if self.rounds else None


@dataclass(frozen=True)
class RequestOutput:
    prompt_token_ids: tuple[int, ...]
    text: str | None  # None when the checkpoint has no tokenizer
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length" | "cancelled"
    spec: SpecDecodeStats
    timing: RequestTiming
    result: GenerationResult = field(repr=False)  # every round's record


class LLM:
    """A checkpoint loaded once (default: the shipped mini model) with one backend: the
    IQuestRT engine (`backend="runtime"`, compiled kernels on a GPU, twins on a CPU) or the
    slow reference. One request at a time: a second caller waits for the first."""

    def __init__(self, model: str | Path | None = None, options: EngineOptions | None = None,
                 **kw):
        if options is not None and kw:
            raise ValueError(f"LLM: pass either options or keyword options, not both "
                             f"({sorted(kw)})")
        self.options = options or EngineOptions(**kw)
        self.model = Path(model) if model is not None else assets.default_model()
        t = time.perf_counter()
        self.checkpoint = load_checkpoint(self.model)
        self.cfg = self.checkpoint.cfg
        self.tokenizer = checkpoint_tokenizer(self.model)
        self.backend = build_backend(self.checkpoint, self.options)
        self.load_s = time.perf_counter() - t
        self._lock = threading.Lock()

    # --- requests -------------------------------------------------------------------------------
    def request(self, prompt: str | Sequence[int], params: SamplingParams) -> GenerationRequest:
        """The engine request for (prompt, params), checked against the model: ValueError
        naming the field otherwise."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt)
        s = self.cfg.sampling
        for name in ("temperature", "top_k", "top_p"):
            if getattr(params, name) is not None:
                s = replace(s, **{name: getattr(params, name)})
        stops = params.stop_token_ids
        if not params.ignore_eos:
            stops += tuple(i for i in self.eos_token_ids if i not in stops)
        req = GenerationRequest(prompt_ids=ids, max_new_tokens=params.max_tokens, sampling=s,
                                seed=params.seed, stop_ids=stops)
        self.backend.check(req)
        return req

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(getattr(self.cfg, "eos_token_ids", ()) or ())

    def encode(self, prompt: str | Sequence[int]) -> tuple[int, ...]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt: {self.model} has no tokenizer.json; pass token ids")
            ids = tuple(self.tokenizer.encode(prompt).ids)
        else:
            ids = tuple(prompt)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError("prompt: expected text or a sequence of integer token ids")
        if not ids:
            raise ValueError("prompt: empty (at least one token)")
        return ids

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None
                 ) -> RequestOutput:
        return self.run(self.request(prompt, params or SamplingParams()))

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None
               ) -> TextStream:
        """A TextStream of text deltas (token ids when there is no tokenizer); checked before
        anything runs."""
        return self.submit(self.request(prompt, params or SamplingParams()))

    def run(self, req: GenerationRequest) -> RequestOutput:
        """A request from `request()`, to its end."""
        text = _Text(self.tokenizer)

        def sink(new: list[int]) -> None:
            text.push(new)

        with self._lock:
            res = self.backend.generate(req, sink)
        return self._output(req, res, text)

    def submit(self, req: GenerationRequest) -> TextStream:
        """A request from `request()`, streamed."""
        return TextStream(self, req)

    def _output(self, req: GenerationRequest, res: GenerationResult, text: _Text
                ) -> RequestOutput:
        t = res.timing
        timing = RequestTiming(t.prefill_s, t.setup_s, t.decode_s, t.captured, len(res.rounds),
                               len(res.tokens))
        return RequestOutput(req.prompt_ids, text.text if self.tokenizer else None,
                             tuple(res.tokens), res.stop_reason, SpecDecodeStats.of(res),
                             timing, res)

    def close(self) -> None:
        self.backend.close()


class _Text:
    """Incremental detokenization (tokenizers' DecodeStream): a character split over tokens
    comes out once complete, never as U+FFFD; the concatenated deltas are the text."""

    def __init__(self, tokenizer):
        self.tok, self.parts = tokenizer, []
        if tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            self.decoder = DecodeStream(skip_special_tokens=True)  # Tokenizer.decode's default

    def push(self, ids: list[int]) -> str:
        if self.tok is None:
            return ""
        out = "".join(p for p in (self.decoder.step(self.tok, i) for i in ids) if p)
        self.parts.append(out)
        return out

    @property
    def text(self) -> str:
        return "".join(self.parts)


_END = object()


class TextStream:
    """Iterator of text deltas (lists of token ids without a tokenizer) of one request running
    in a worker thread. cancel() stops the request at its next log read; leaving a `with` block
    or closing the iterator early cancels too. `output` is the RequestOutput once finished.
    A wait for the next delta is bounded by EngineOptions.stream_timeout_s."""

    def __init__(self, llm: LLM, req: GenerationRequest):
        self.llm, self.req = llm, req
        self.output: RequestOutput | None = None
        self.tokens = 0  # handed over so far
        self._cancel = threading.Event()
        self._q: queue.Queue = queue.Queue()
        self._text = _Text(llm.tokenizer)
        self._error: BaseException | None = None
        self._cuda_index = (torch.cuda.current_device()
                            if llm.backend.device.type == "cuda" else None)
        self._thread = threading.Thread(target=self._run, name="iquestrt-stream", daemon=True)
        self._thread.start()

    def _bind_device(self) -> None:
        """The current CUDA device is per thread: the worker takes the engine's (an engine on
        "cuda" without an index runs on the device current where the stream was made)."""
        device = self.llm.backend.device
        if device.type == "cuda":
            torch.cuda.set_device(device.index if device.index is not None else self._cuda_index)

    def _run(self) -> None:
        def sink(new: list[int]):
            self.tokens += len(new)
            delta = self._text.push(new) if self.llm.tokenizer is not None else list(new)
            if delta:
                self._q.put(delta)
            return not self._cancel.is_set()

        try:  # every failure, the device binding's too, reaches the iterating thread
            self._bind_device()
            with self.llm._lock:
                res = self.llm.backend.generate(self.req, sink)
            self.output = self.llm._output(self.req, res, self._text)
        except BaseException as e:  # handed to the iterating thread
            self._error = e
        finally:
            self._q.put(_END)

    def cancel(self) -> None:
        self._cancel.set()

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        try:
            item = self._q.get(timeout=self.llm.options.stream_timeout_s)
        except queue.Empty:
            self.cancel()
            raise TimeoutError(f"stream: no token for {self.llm.options.stream_timeout_s} s "
                               f"(EngineOptions.stream_timeout_s); the request was cancelled"
                               ) from None
        if item is _END:
            self._q.put(_END)  # later next() calls end too
            if self._error is not None:
                raise self._error
            raise StopIteration
        return item

    def close(self) -> RequestOutput | None:
        """Cancel if still running and wait for the worker (bounded); the output."""
        self.cancel()
        self._thread.join(self.llm.options.stream_timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"stream: the request did not stop within "
                               f"{self.llm.options.stream_timeout_s} s of its cancel")
        return self.output

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
