"""The state of one request inside the engine (iquestrt/engine.py), shared with its parts
(iquestrt/engine_parts.py): its caches, readiness flags, tokens by position, the rounds run and
the result so far, and the device state once the rounds start."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from iquestrt.cache import RuntimeCaches
from iquestrt.state import DeviceState
from reference.speculative import GenerationRequest, GenerationResult


@dataclass
class Session:
    """State of the running (or last) request; on_round callbacks may inspect it."""

    req: GenerationRequest
    caches: RuntimeCaches
    flags: torch.Tensor  # [L] int32: readiness failure flag of each target layer
    tokens: list[int]  # prompt + emitted tokens, by position
    rounds: int = 0
    result: GenerationResult = field(default_factory=lambda: GenerationResult(tokens=[]))
    device: DeviceState | None = None
