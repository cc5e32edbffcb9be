"""Engine reuse: one engine serving a sequence of requests gives every request exactly what a
freshly built engine gives it.

An engine keeps its caches, readiness flags, device state and round program (on a GPU its
captured graphs) across requests of one shape (top_k / greedy, stop-id room, capacities) and
refills them in place (DeviceState.begin): budget, stop ids, seed, sampling values, counters and
log. Here one engine on the trained mini model serves three requests of one shape (top_k 20)
that differ in everything else — temperature, top-p, budget, stop ids, seed (one ≥ 2^63, given
to the device as int64 bits), prompt — and each must equal a fresh engine serving it alone, bit
for bit: tokens, stop reason, every round record, and what the caches hold afterwards.

The requests are chosen so that a leftover shows: request 2 ends on one of its stop ids; request
2's stop id is a token request 3 emits (a stop list kept from request 2 ends request 3 early);
request 3 runs at another temperature than request 2 and is longer (a kept budget ends it early).
The gate also requires that the engine really reused its state and round program (built once,
reused twice): otherwise it compared fresh engines with fresh engines.

Ops: twins on the CPU; kernels with CUDA graphs on a GPU (the captured round replays on the
refilled buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

from qualification import device_engine, mini_engine
from reference.config import SamplingDefaults
from reference.depth import FixedDepth
from reference.speculative import GenerationRequest


@dataclass(frozen=True)
class RequestSpec:
    kind: str  # the request kind whose median prompt is used (mini_engine.prompts)
    prompt_tokens: int
    new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReuseGateConfig:
    depth: int = 3
    top_k: int = 20  # one request shape: the state and round program serve all three
    requests: tuple[RequestSpec, ...] = (
        RequestSpec("docstring", 20, 24, 1.0, 0.95, 3),
        RequestSpec("completion", 16, 16, 0.7, 0.8, 2**63 + 5, (3676, 282)),
        RequestSpec("edit", 24, 28, 1.3, 0.9, 11, (4,)),
    )


def requests(g: ReuseGateConfig) -> list[GenerationRequest]:
    out = []
    for r in g.requests:
        (prompt,) = mini_engine.prompts(r.prompt_tokens, kinds=(r.kind,))
        out.append(GenerationRequest(prompt.ids, r.new_tokens,
                                     SamplingDefaults(r.temperature, g.top_k, r.top_p), r.seed,
                                     r.stop_ids))
    return out


def run(g: ReuseGateConfig | None = None) -> tuple[bool, str, list[str]]:
    from iquestrt.engine import EngineError

    g = g or ReuseGateConfig()
    w = device_engine.weights(mini_engine.load_mini())
    policy = FixedDepth(g.depth)
    reused = device_engine.engine(w, policy, graphs=True)
    ev, facts = [], []
    for i, req in enumerate(requests(g), 1):
        want = device_engine.outcome(device_engine.engine(w, policy, graphs=True), req)
        try:
            got = device_engine.outcome(reused, req)
        except (EngineError, ValueError) as e:  # e.g. a kept budget: the device ends too early
            bad = [f"the reused engine raised {type(e).__name__}: {e}"]
        else:
            bad = device_engine.differences(got, want, " from a fresh engine's")
        if bad:
            ev.append(f"request {i} ({device_engine.describe(req)}): " + "; ".join(bad))
        facts.append(f"{len(want.tokens)} tokens / {len(want.records)} rounds, "
                     f"{want.stop_reason}")
    built, again = reused.programs.built, reused.programs.reused
    if (built, again) != (1, len(g.requests) - 1):
        ev.append(f"the engine built {built} and reused {again} round programs: the requests "
                  f"did not all run on reused state (the comparison would prove nothing)")
    ok = not ev
    ops = reused.rcfg.ops + (" with CUDA graphs" if reused.rcfg.graphs else "")
    ev.append(f"{ops}, depth {g.depth}: requests " + "; ".join(
        f"{i} {f}" for i, f in enumerate(facts, 1)) + f"; program built {built}, reused {again}"
        + ("; every request equals a fresh engine's (tokens, records, caches)" if ok else ""))
    return ok, "exact" if ok else "differs", ev
