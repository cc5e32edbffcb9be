"""Adaptive draft depth: the decisions the engine's round program takes on the device equal the
reference policy's decisions recomputed on every round's recorded features.

With an AdaptiveDepth policy the round program decides after each depth j ≥ min_depth, on the
device and without a host read, whether depth j + 1 runs (iquestrt/round.py: push_features of
q(y_j) and the served row's entropy, then AdaptiveDepth.more_batch). A round record carries what
the reference policy decides from: the drafts y_1 … y_d with q(y_j) and the entropy of the
served row (reference/speculative.py's DraftInfo). For every round of d drafts the reference
AdaptiveDepth.more (host fp32 arithmetic, reference/depth.py) must say "one more" after
1 … d − 1 drafts and "stop" after d (unless d = max_depth, where no decision is taken).

Policies: the mini model's fitted policy (models/mini/depth_policy.json) and the unfitted prior
(reference.depth.default_adaptive); each decodes the median prompt of every request kind with
every seed. "One more" is rare (a handful in a hundred decisions), and one seed's decode of the
kernels can have none for a policy while the twins' has three, so each policy must decide both
ways here, or the gate fails for want of evidence. The margin is the smallest |s_j − threshold|
over the decisions compared at decision depths: how far the closest decision was from flipping.
Sensitivity, per policy: a device whose comparison is offset upward by more than the smallest
s_j − threshold of a "more" (or downward by more than that of a "stop") flips a compared
decision, so the evidence states both.

Ops: twins on the CPU; kernels with CUDA graphs on a GPU (the later depths sit in conditional
nodes, iquestrt/cond_graph.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from corpus.requests import KINDS
from qualification import device_engine, mini_engine
from reference.depth import AdaptiveDepth, default_adaptive, host_features, load_policy
from reference.speculative import GenerationRequest


@dataclass(frozen=True)
class DepthPolicyGateConfig:
    policies: tuple[str, ...] = ("fitted", "prior")
    kinds: tuple[str, ...] = KINDS
    prompt_tokens: int = 20
    new_tokens: int = 48
    seeds: tuple[int, ...] = (5, 6, 7)


QUICK = DepthPolicyGateConfig(kinds=("completion",))  # qualify --quick: one prompt per seed


def policy(name: str) -> AdaptiveDepth:
    if name == "prior":
        return default_adaptive()
    p = load_policy(mini_engine.MINI)
    if name != "fitted" or not isinstance(p, AdaptiveDepth):
        raise ValueError(f"DepthPolicyGateConfig.policies: {name!r} (the mini model ships an "
                         f"adaptive policy: 'fitted'; or 'prior')")
    return p


@dataclass
class Tally:
    rounds: int = 0
    decisions: int = 0  # at decision depths min_depth … max_depth − 1
    forced: int = 0  # after 1 … min_depth − 1 drafts: "one more" without a score
    more: int = 0  # decisions "one more" at decision depths
    closest: float = float("inf")  # min |s − threshold| over decisions
    above: float = float("inf")  # min s − threshold over "more" decisions
    below: float = float("inf")  # min threshold − s over "stop" decisions
    first_bad: str | None = None


def check_rounds(p: AdaptiveDepth, rounds, where: str, t: Tally) -> None:
    for i, r in enumerate(rounds):
        t.rounds += 1
        d = len(r.drafts)
        for j in range(1, min(d, p.max_depth - 1) + 1):
            want = p.more(r.drafts[:j])  # the reference's decision after j drafts
            ran = j < d  # the device's: depth j + 1 ran
            if j < p.min_depth:
                t.forced += 1
            else:
                t.decisions += 1
                t.more += ran
                s = p.score(j, *host_features(r.drafts[:j]))
                t.closest = min(t.closest, abs(s - p.threshold))
                if ran:
                    t.above = min(t.above, s - p.threshold)
                else:
                    t.below = min(t.below, p.threshold - s)
            if want != ran and t.first_bad is None:
                score = (f"s = {p.score(j, *host_features(r.drafts[:j])):.6g} vs threshold "
                         f"{p.threshold:.6g}" if j >= p.min_depth else "a forced depth")
                did = f"ran depth {j + 1}" if ran else "stopped"
                t.first_bad = (f"{where} round {i} (m = {r.position}): after {j} drafts the "
                               f"device {did}, the reference says "
                               f"{'more' if want else 'stop'} ({score})")
        if d < p.min_depth or d > p.max_depth:
            t.first_bad = t.first_bad or (f"{where} round {i}: {d} drafts, outside "
                                          f"[{p.min_depth}, {p.max_depth}]")


def run(g: DepthPolicyGateConfig | None = None) -> tuple[bool, str, list[str]]:
    g = g or DepthPolicyGateConfig()
    w = device_engine.weights(mini_engine.load_mini())
    prompts = mini_engine.prompts(g.prompt_tokens, kinds=g.kinds)
    if not g.seeds:
        raise ValueError("DepthPolicyGateConfig.seeds: empty (at least one seed)")
    ev, facts, closest = [], [], float("inf")
    for name in g.policies:
        p = policy(name)
        eng = device_engine.engine(w, p, graphs=True)
        t, depths = Tally(), Counter()
        for seed in g.seeds:
            for prompt in prompts:
                res = eng.generate(GenerationRequest(prompt.ids, g.new_tokens,
                                                     mini_engine.SAMPLING, seed))
                depths.update(len(r.drafts) for r in res.rounds)
                check_rounds(p, res.rounds, f"{name} policy, {prompt.id}, seed {seed}", t)
        if t.first_bad:
            ev.append(t.first_bad)
        if t.more in (0, t.decisions):
            ev.append(f"{name} policy: all {t.decisions} decisions were "
                      f"'{'more' if t.more else 'stop'}' (nothing to tell a wrong decision from)")
        closest = min(closest, t.closest)
        facts.append(f"{name} (threshold {p.threshold:.6g}): {t.rounds} rounds, depths "
                     f"{dict(sorted(depths.items()))}, {t.decisions} decisions compared "
                     f"({t.more} more, {t.decisions - t.more} stop) + {t.forced} forced; "
                     f"a device offset above {t.above:.3g} or below -{t.below:.3g} flips one")
    ok = not ev
    ops = "kernels with CUDA graphs" if device_engine.on_gpu() else "twins"
    ev.append(f"{ops}, {len(prompts)} prompts x {len(g.seeds)} seeds x {g.new_tokens} tokens: "
              + "; ".join(facts)
              + ("; every device decision equals the reference's" if ok else ""))
    return ok, f"closest decision |s - threshold| = {closest:.3g}", ev
