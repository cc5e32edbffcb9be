"""Decoding for the acceptance report: one backend per depth policy, round timing, and the
target's expert routing of the generated positions.

Timing. `round_end_s[i]` is host wall time (time.perf_counter) from the generate() call to the
on_round callback of round i. Round 0 therefore includes the prefill (and, on the runtime, the
round program's setup); later differences are one round each. With an on_round callback the
engine reads its result log after every round (iquestrt/engine.py), so on a GPU every round
also pays one device→host read; on a CPU the time is all host work (twins or the reference).

Routing. The engine does not expose its router choices, so the target's routing is recomputed:
a ReferenceModel subclass records the top-k ids of every MoE layer while the target runs once
over prompt + generated tokens, and the rows of the generated positions are kept. With the
runtime backend that model runs in "bf16-fold" precision (the runtime's router input), so a
near-tie may route differently from the runtime's FP8 activations.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from iquestrt.report.prompts import Prompt
from reference import ops
from reference.checkpoint import Checkpoint
from reference.depth import AdaptiveDepth, FixedDepth
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, GenerationResult, ReferenceGenerator

Policy = FixedDepth | AdaptiveDepth
RunFn = Callable[[GenerationRequest, Callable], GenerationResult]


@dataclass
class Decoded:
    prompt: Prompt
    seed: int
    policy: str  # its label, e.g. "adaptive" or "fixed-3"
    result: GenerationResult
    round_end_s: list[float]  # per round: seconds from generate() to its record
    wall_s: float  # the whole generate() call
    routing: torch.Tensor  # [Lm, T, K] int64: target expert ids, MoE layers × generated positions


class RoutingModel(ReferenceModel):
    """The reference model, recording the target routers' top-k ids while `record` is a dict."""

    record: dict[int, list[torch.Tensor]] | None = None

    def _moe(self, pre, x, top_k, router_in=None):
        if self.record is not None and pre.startswith("model.layers."):
            src = x if router_in is None else router_in
            _, ids = ops.route(src, self.p[pre + "mlp.router.weight"], top_k)
            self.record.setdefault(int(pre.split(".")[2]), []).append(ids)
        return super()._moe(pre, x, top_k, router_in)

    def routing(self, prompt: tuple[int, ...], generated: list[int]) -> torch.Tensor:
        """Target routing of the generated positions → [Lm, T, K] (Lm MoE layers in order)."""
        tokens = torch.tensor(list(prompt) + list(generated))
        self.record = {}
        try:
            with torch.no_grad():
                self.target(tokens, torch.arange(tokens.shape[0]))
            rec = self.record
        finally:
            self.record = None
        layers = sorted(rec)
        return torch.stack([torch.cat(rec[i])[len(prompt):] for i in layers])


def policy_label(policy: Policy) -> str:
    return "adaptive" if isinstance(policy, AdaptiveDepth) else f"fixed-{policy.depth}"


@dataclass(frozen=True)
class BackendSpec:
    backend: str = "reference"  # "reference" | "runtime"
    ops: str = "auto"  # runtime: "kernels" | "twins" | "auto"
    precision: str | None = None  # reference: fp32 | bf16 | matched (default bf16)
    max_positions: int = 0  # runtime cache: longest prompt + max_new_tokens + round width
    graphs: str = "auto"  # runtime: "on" | "off" | "auto" (on with kernels on a GPU)


class Decoders:
    """Builds, once each, the reference model (also the routing model when precisions agree)
    and the runtime weights; hands out a run function per depth policy."""

    def __init__(self, ckpt: Checkpoint, spec: BackendSpec):
        self.ckpt, self.spec = ckpt, spec
        self._models: dict[str, RoutingModel] = {}
        self._weights = None
        self.graphs_used = "off"  # what the runtime backend ran with: "on" | "off"

    def model(self, precision: str) -> RoutingModel:
        if precision not in self._models:
            self._models[precision] = RoutingModel(self.ckpt.cfg, self.ckpt.dequantized(),
                                                   precision=precision)
        return self._models[precision]

    @property
    def routing_precision(self) -> str:
        s = self.spec
        if s.backend == "runtime" or s.precision == "matched":
            return "bf16-fold"  # the runtime's router input; matched would run row by row
        return s.precision or "bf16"

    def runner(self, policy: Policy) -> RunFn:
        s = self.spec
        if s.backend == "reference":
            gen = ReferenceGenerator(self.model(s.precision or "bf16"), policy)
            return gen.generate
        if s.precision is not None:
            raise ValueError("--precision: applies to --backend reference only")
        gpu = torch.cuda.is_available()
        ops_kind = s.ops if s.ops != "auto" else ("kernels" if gpu else "twins")
        if ops_kind == "kernels" and not gpu:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernels import
        from iquestrt.config import RuntimeConfig
        from iquestrt.engine import Engine
        from iquestrt.weights import from_checkpoint

        graphs = s.graphs == "on" or (s.graphs == "auto" and gpu and ops_kind == "kernels")
        self.graphs_used = "on" if graphs else "off"
        rcfg = RuntimeConfig(ops=ops_kind, device="cuda" if gpu else "cpu",
                             max_positions=s.max_positions, policy=policy, graphs=graphs)
        if self._weights is None:
            self._weights = from_checkpoint(self.ckpt, rcfg.device, s.max_positions)
        return Engine(self._weights, rcfg).generate

    def decode(self, run: RunFn, prompt: Prompt, seed: int, label: str,
               req: GenerationRequest) -> Decoded:
        ends: list[float] = []
        t0 = time.perf_counter()
        res = run(req, lambda rec: ends.append(time.perf_counter() - t0))
        wall = time.perf_counter() - t0
        routing = self.model(self.routing_precision).routing(prompt.ids, res.tokens)
        return Decoded(prompt, seed, label, res, ends, wall, routing)
