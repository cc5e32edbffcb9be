"""The OpenAI-compatible app over one `LLM`: /v1/completions, /v1/chat/completions (both with
`stream: true` as server-sent events ending in `data: [DONE]`), /v1/models, /health, /metrics.

One request runs at a time (a single-request runtime); up to ServerConfig.max_queue more wait
in arrival order, and a request beyond that gets 429 with Retry-After. Every bad request gets
400 with an OpenAI-style error body naming the field, before the engine is touched; a fault
during decoding ends that request with 500 (an error event when streamed) and the server goes on
serving. A streamed
request whose client goes away is cancelled: the engine stops at its next log read (about every
32 tokens on a GPU) and the next request starts then.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from iquestrt.api import LLM, RequestOutput
from iquestrt.errors import RuntimeFault
from iquestrt.server import chat
from iquestrt.server.metrics import ServerMetrics
from iquestrt.server.schema import ChatRequest, CompletionRequest, error_body

log = logging.getLogger("iquestrt.server")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str = "iquestrt"
    max_queue: int = 8  # requests waiting behind the running one before 429
    retry_after_s: int = 1  # the 429's Retry-After


class Admission:
    """The running request and the queue behind it: `enter` refuses beyond 1 + max_queue;
    the engine lock is taken in arrival order (asyncio.Lock is FIFO)."""

    def __init__(self, max_queue: int, metrics: ServerMetrics):
        self.limit, self.held, self.metrics = 1 + max_queue, 0, metrics
        self.engine = asyncio.Lock()

    def enter(self) -> bool:
        if self.held >= self.limit:
            return False
        self.held += 1
        return True

    async def acquire(self) -> None:
        self._gauges(waiting=1)
        try:
            await self.engine.acquire()
        finally:
            self._gauges(waiting=-1)
        self._gauges(running=1)

    def release(self, ran: bool) -> None:
        if ran:
            self._gauges(running=-1)
            self.engine.release()
        self.held -= 1

    def _gauges(self, running: int = 0, waiting: int = 0) -> None:
        m = self.metrics
        m.running.labels(m.model).inc(running)
        m.waiting.labels(m.model).inc(waiting)


def _param(message: str) -> str | None:
    """The request field an LLM.request error names."""
    head = message.split(":", 1)[0].split(" ", 1)[0]
    field = head.rsplit(".", 1)[-1]
    return {"prompt_ids": "prompt", "stop_ids": "stop_token_ids", "max_new_tokens": "max_tokens",
            "top_k=0": "top_k"}.get(field, field) if field else None


def create_app(llm: LLM, cfg: ServerConfig | None = None) -> FastAPI:
    cfg = cfg or ServerConfig()
    app = FastAPI(title="IQuestRT", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(cfg.model_name, llm.cfg.draft.num_draft_slots)
    admission = Admission(cfg.max_queue, metrics)
    ids = itertools.count()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError):
        e = exc.errors()[0]
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if e.get("type") == "json_invalid":  # loc holds the character position
            msg, param = f"malformed JSON at character {loc[-1] if loc else '?'}", None
        elif e.get("type") == "extra_forbidden":
            msg = f"unknown field {param!r}"
        else:
            msg = f"{param}: {e.get('msg')}" if param else str(e.get("msg"))
        return JSONResponse(error_body(msg, param), status_code=400)

    def bad(message: str, param: str | None) -> JSONResponse:
        return JSONResponse(error_body(message, param), status_code=400)

    def fault_body(e: Exception) -> dict:
        """A fault during decoding (iquestrt/errors.py: RuntimeFault names round and layer);
        anything else is an internal error, logged with its traceback."""
        metrics.failed.labels(metrics.model).inc()
        if not isinstance(e, RuntimeFault):
            log.exception("internal error while serving a request")
        return error_body(f"the request failed: {type(e).__name__}: {e}", None, "server_error")

    def fault(e: Exception) -> JSONResponse:
        return JSONResponse(fault_body(e), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model",
                                            "owned_by": "iquestrt",
                                            "max_model_len": llm.backend.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    async def serve(body, prompt, kind: str):
        if body.model not in (None, cfg.model_name):
            return bad(f"model {body.model!r} is not served here (GET /v1/models: "
                       f"{cfg.model_name!r})", "model")
        try:
            req = llm.request(prompt, body.params())
        except ValueError as e:
            return bad(str(e), _param(str(e)))
        if not admission.enter():
            return JSONResponse(error_body(f"the server is busy: one request running and "
                                           f"{cfg.max_queue} waiting", None, "rate_limit_error"),
                                status_code=429,
                                headers={"Retry-After": str(cfg.retry_after_s)})
        rid, arrived = f"{kind}-{next(ids)}", time.perf_counter()
        if body.stream:
            return StreamingResponse(_events(req, rid, kind, arrived),
                                     media_type="text/event-stream")
        ran = False
        try:
            await admission.acquire()
            ran = True
            queued = time.perf_counter() - arrived
            out = await asyncio.to_thread(llm.run, req)
        except Exception as e:  # noqa: BLE001 — a fault ends this request, never the server
            return fault(e)
        finally:
            admission.release(ran)
        metrics.finished(out, queued + out.timing.prefill_s)
        return _response(out, rid, kind)

    def _chunk(rid: str, kind: str, text: str, finish: str | None, first: bool = False) -> str:
        if kind == "chat":
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()),
                                      "model": cfg.model_name, "choices": [choice]}) + "\n\n"

    async def _events(req, rid: str, kind: str, arrived: float):
        stream, ran, ttft, reported = None, False, None, False
        try:
            await admission.acquire()
            ran = True
            stream = llm.submit(req)
            first = True
            while True:
                delta = await asyncio.to_thread(_next, stream)
                if delta is None:
                    break
                if ttft is None:
                    ttft = time.perf_counter() - arrived
                yield _chunk(rid, kind, delta if isinstance(delta, str) else "", None, first)
                first = False
            out = stream.output
            yield _chunk(rid, kind, "", out.finish_reason, first)
            yield "data: [DONE]\n\n"
            metrics.finished(out, ttft if ttft is not None else time.perf_counter() - arrived)
            reported = True
        except Exception as e:  # noqa: BLE001 — a fault mid-stream: an error event, then the end
            reported = True
            yield "data: " + json.dumps(fault_body(e)) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            try:
                if stream is not None:
                    stream.cancel()  # a client gone: the engine stops at its next log read
                    # Starlette cancels through anyio, whose cancellation repeats at every
                    # await of the cancelled scope: only a shielded scope can wait for the end
                    with anyio.CancelScope(shield=True):
                        out = await anyio.to_thread.run_sync(stream.close)
                    if out is not None and not reported:
                        metrics.finished(out, ttft if ttft is not None else
                                         time.perf_counter() - arrived)
            finally:
                admission.release(ran)

    def _response(out: RequestOutput, rid: str, kind: str) -> dict:
        text = out.text or ""
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": out.finish_reason} if kind == "chat" else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason})
        t, s = out.timing, out.spec
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": cfg.model_name, "choices": [choice],
                "usage": {"prompt_tokens": len(out.prompt_token_ids),
                          "completion_tokens": len(out.token_ids),
                          "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)},
                "token_ids": list(out.token_ids),
                "metrics": {"prefill_s": t.prefill_s, "setup_s": t.setup_s,
                            "decode_s": t.decode_s, "rounds": t.rounds,
                            "time_per_output_token_s": t.time_per_output_token_s,
                            "speculative_decoding": {
                                "num_drafts": s.num_drafts,
                                "num_draft_tokens": s.num_draft_tokens,
                                "num_accepted_tokens": s.num_accepted_tokens,
                                "accepted_per_position": list(s.accepted_per_position),
                                "mean_acceptance_length": s.mean_acceptance_length}}}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await serve(body, body.prompt, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        return await serve(body, chat.render(body.messages), "chat")

    return app


def _next(stream):
    """The stream's next delta, None at its end (StopIteration cannot cross to_thread)."""
    return next(stream, None)
