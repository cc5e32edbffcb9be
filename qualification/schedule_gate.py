"""Gate 3e — scheduling pairs on the GPU (bit-exactness, gate 3): launching the same request
eagerly, as one CUDA graph per round from the host loop, or as the device loop (a WHILE graph
node), with the log read every round, every few rounds, once, or per streamed chunk, rerunning
it, and each launch mode with programmatic dependent launch, must give the same bits: output
tokens, every round's drafts / q(y) / entropies / acceptance / depth and a digest of every cache
after the request. Fixed depth 3 and the model's fitted adaptive
policy (its later depths in IF nodes under graphs, 0-row kernels when eager) on the mini model
with compiled kernels.

GPU only: graphs and conditional nodes do not exist on the CPU, and this gate never pretends to
test them there (verdict "GPU only", not a pass). The same pairs run in the GPU pytest suites
(tests/engine/test_engine_graphs.py, tests/engine/test_engine_device_loop.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qualification import mini_engine
from reference.depth import FixedDepth, policy_from_spec
from reference.speculative import GenerationRequest


@dataclass(frozen=True)
class ScheduleGateConfig:
    prompt_tokens: int = 96
    new_tokens: int = 48
    seed: int = 11


# variant → RuntimeConfig overrides and how the host watches the request
VARIANTS = {
    "eager": (dict(graphs=False), None),
    "graph, log every 4 rounds": (dict(graphs=True, sync_rounds=4), None),
    "graph, rerun": (dict(graphs=True, sync_rounds=4), None),
    "graph, log every round": (dict(graphs=True), "rounds"),
    "device loop, one launch": (dict(graphs=True, loop="device"), None),
    "device loop, streamed": (dict(graphs=True, loop="device"), "tokens"),
    # programmatic dependent launch (kernels/launch.py): every kernel waits before touching
    # memory, so the bits may not move
    "eager, PDL": (dict(graphs=False, pdl=True), None),
    "graph, PDL": (dict(graphs=True, sync_rounds=4, pdl=True), None),
    "device loop, PDL": (dict(graphs=True, loop="device", pdl=True), None),
}


def _signature(ckpt, policy, over: dict, watch: str | None, req: GenerationRequest):
    from iquestrt.config import RuntimeConfig
    from iquestrt.engine import Engine
    from iquestrt.snapshot import caches_digest

    over = {"pdl": False, **over}  # the plain variants without PDL (its default is on)
    rcfg = RuntimeConfig(ops="kernels", device="cuda", ring_pad=mini_engine.RING_PAD,
                         max_positions=512, policy=policy, **over)
    eng = Engine.from_checkpoint(ckpt.directory, rcfg)
    chunks: list[list[int]] = []
    res = eng.generate(req, on_round=(lambda r: None) if watch == "rounds" else None,
                       on_tokens=chunks.append if watch == "tokens" else None)
    rounds = [(r.position, [(d.token, d.prob, d.entropy) for d in r.drafts], r.accepted,
               r.emitted, r.bonus) for r in res.rounds]
    if watch == "tokens" and sum(chunks, []) != res.tokens:
        raise AssertionError("streamed chunks do not add up to the result's tokens")
    return res.tokens, rounds, caches_digest(eng.session.caches)


def run(g: ScheduleGateConfig | None = None) -> tuple[bool | None, str, list[str]]:
    """(ok, margin, evidence); ok None when no GPU is present."""
    g = g or ScheduleGateConfig()
    if not torch.cuda.is_available():
        return None, "-", ["needs a CUDA GPU (graphs, conditional nodes): not run on the CPU; "
                           "the GPU pytest suites hold the same pairs"]
    ckpt = mini_engine.load_mini()
    prompt = mini_engine.prompts(g.prompt_tokens)[0]
    req = GenerationRequest(prompt.ids, g.new_tokens, mini_engine.SAMPLING, g.seed)
    ok, evidence = True, []
    for name, policy in (("fixed depth 3", FixedDepth(3)),
                         ("adaptive (depth_policy.json)", policy_from_spec("adaptive",
                                                                          ckpt.directory))):
        sigs = {v: _signature(ckpt, policy, over, watch, req)
                for v, (over, watch) in VARIANTS.items()}
        ref = sigs["eager"]
        differ = [v for v, s in sigs.items() if s != ref]
        depths = sorted({len(r[1]) for r in ref[1]})
        if differ:
            ok = False
            for v in differ:
                s = sigs[v]
                first = next((i for i, (a, b) in enumerate(zip(s[1], ref[1], strict=False))
                              if a != b), min(len(s[1]), len(ref[1])))
                evidence.append(f"{name}: {v} differs from eager (first differing round {first};"
                                f" tokens {'equal' if s[0] == ref[0] else 'differ'}; caches "
                                f"{'equal' if s[2] == ref[2] else 'differ'})")
        else:
            evidence.append(f"{name}: {len(VARIANTS)} variants identical — {len(ref[0])} tokens, "
                            f"{len(ref[1])} rounds, depths {depths}, caches {ref[2][:12]}…")
    return ok, "exact", evidence
