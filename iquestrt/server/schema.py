"""Request bodies of the OpenAI-compatible endpoints (pydantic, unknown fields refused), and the
OpenAI-style error body. Extensions to OpenAI's fields: top_k, stop_token_ids, ignore_eos; a
missing seed is 0 (every draw is keyed by seed, position and purpose: same request, same
tokens)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from iquestrt.api import SamplingParams

U64 = 2**64


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int = Field(0, ge=0, lt=U64)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    n: int = Field(1, ge=1, le=1)  # one sequence per request
    user: str | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              max_tokens=self.max_tokens, seed=self.seed,
                              stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos)


class CompletionRequest(_Sampling):
    prompt: str | list[int]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)


def error_body(message: str, param: str | None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
