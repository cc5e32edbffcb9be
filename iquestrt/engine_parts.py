"""What an Engine (iquestrt/engine.py) is composed of, passed to it at construction: the op
table, the target and draft models, the round programs, where a request's prefill comes from,
how its caches are made, and observers that wrap a request's phases. `EngineParts.default`
builds the single-GPU engine's parts; the tensor-parallel engine, the rank benchmark's, the
snapshot and experiment engines build theirs from it and replace what differs
(dataclasses.replace) — none overrides an Engine method or patches a part after construction.

Phases an observer wraps (each gets a thunk that runs the phase and must call it once):
  request  the whole of Engine.generate, validation included (the TP rings re-arm here: a
           collective every rank runs before the request);
  prepare  building the device state and the round program — a CUDA-graph capture when graphs
           are on — outside the decode clock; returns the launcher;
  loop     the decode loop: every round launched, the log read, the request's end settled.
Observers are applied in order, the first innermost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from iquestrt.cache import RuntimeCaches
from iquestrt.draft import DraftModel
from iquestrt.graphs import RoundPrograms
from iquestrt.model import TargetModel
from iquestrt.ops import Live, OpTable, make_ops
from iquestrt.session import Session
from reference.rng import Purpose

if TYPE_CHECKING:
    from iquestrt.config import RuntimeConfig
    from iquestrt.weights import Weights
    from reference.config import ModelConfig


class EngineView(Protocol):
    """What a part may use of the engine it serves (iquestrt/engine.py's Engine, which imports
    this module)."""

    w: Weights
    rcfg: RuntimeConfig
    cfg: ModelConfig
    ops: OpTable
    target: TargetModel
    draft: DraftModel

    def check_logits(self, where: str, st: Session, logits: torch.Tensor, n: int,
                     target: bool) -> None: ...


CacheFactory = Callable[[int], RuntimeCaches]  # capacity (positions) → a request's caches


class Prefill(Protocol):
    """Where a request's prefill comes from. `target` fills the target caches with positions
    0 … n−1 of the prompt; `draft` fills the draft cache with positions 1 … n−1 (row p: the
    token at p, the target hidden state of p − 1) and sets caches.draft_next."""

    def target(self, eng: EngineView, st: Session) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (last logits row [1, V] FP32, target final hidden of the prompt [n, H] — at least
        its last row)."""

    def draft(self, eng: EngineView, st: Session, hidden: torch.Tensor) -> None: ...


class ModelPrefill:
    """The models over the prompt, in chunks of max_width rows (the decode path)."""

    def target(self, eng: EngineView, st: Session) -> tuple[torch.Tensor, torch.Tensor]:
        n, rows, dev = len(st.tokens), eng.rcfg.max_width, eng.w.device
        hidden = []
        for c in range(0, n, rows):
            chunk = torch.tensor(st.tokens[c : c + rows], device=dev)
            logits, h = eng.target.forward(chunk, c, st.caches, st.flags)
            eng.check_logits("prefill", st, logits, chunk.shape[0], True)
            hidden.append(h[: chunk.shape[0]].clone())
        st.caches.settle_target(eng.ops, n, n)
        last = chunk.shape[0] - 1
        return logits[last : last + 1], torch.cat(hidden)

    def draft(self, eng: EngineView, st: Session, hidden: torch.Tensor) -> None:
        n, rows, dev, c = len(st.tokens), eng.rcfg.max_width, eng.w.device, st.caches
        for s0 in range(c.draft_next, n, rows):
            e = min(s0 + rows, n)
            toks = torch.tensor(st.tokens[s0:e], device=dev)
            lg, _ = eng.draft.forward(toks, hidden[s0 - 1 : e - 1], s0, c.draft)
            c.draft_next = e
            eng.check_logits("prefill", st, lg, e - s0, False)


def sample_first(eng: EngineView, st: Session, last_logits: torch.Tensor):
    """The first token's draw from the prompt's last logits row → SampleOut."""
    n, dev = len(st.tokens), eng.w.device
    return eng.ops.sample(last_logits, st.req.sampling, st.req.seed,
                          torch.tensor([n], device=dev), Purpose.TARGET_SAMPLE, Live.of(1, dev))


class EngineObserver:
    """Wraps a request's phases (module docstring); each default runs the phase as is."""

    def request(self, eng: EngineView, run: Callable[[], object]) -> object:
        return run()

    def prepare(self, eng: EngineView, st: Session, run: Callable[[], object]) -> object:
        return run()

    def loop(self, eng: EngineView, st: Session, run: Callable[[], None]) -> None:
        run()


@dataclass
class EngineParts:
    ops: OpTable
    target: TargetModel  # or a model of the same interface (iquestrt/tp/model.py)
    draft: DraftModel
    programs: RoundPrograms
    new_caches: CacheFactory
    prefill: Prefill = field(default_factory=ModelPrefill)
    observers: tuple[EngineObserver, ...] = ()
    tensor_parallel: bool = False  # a TP rank's engine: RuntimeConfig.tp_reduce applies

    @classmethod
    def default(cls, weights: Weights, rcfg: RuntimeConfig, prefetcher=None,
                ops: OpTable | None = None) -> EngineParts:
        """The single-GPU engine's parts; `ops`: another op table for the models (the rank
        benchmark's), else RuntimeConfig.ops'. The prefetcher runs when rcfg.prefetch."""
        ops = ops if ops is not None else make_ops(rcfg.ops, rcfg.device, rcfg.max_polls,
                                                   rcfg.pdl)
        cfg, dev = weights.cfg, weights.device
        return cls(
            ops=ops,
            target=TargetModel(weights, ops, rcfg.max_width,
                               prefetcher if rcfg.prefetch else None),
            draft=DraftModel(weights, ops, rcfg.max_width),
            programs=RoundPrograms(rcfg.graphs, rcfg.loop),
            new_caches=lambda capacity: RuntimeCaches.create(cfg, rcfg, capacity, dev),
        )

    def with_observers(self, *more: EngineObserver) -> EngineParts:
        return dataclasses.replace(self, observers=(*self.observers, *more))
