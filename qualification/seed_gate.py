"""Seed width: all 64 bits of a request seed reach the random numbers, on both sides.

A request seed is a uint64 (reference/rng.py: the Philox key is (seed & 0xffffffff, seed >> 32));
the engine's device state holds its bits as int64 (a seed ≥ 2^63 becomes seed − 2^64,
DeviceState.begin), read back as the uint64 by iquestrt.live.host_seed (engine, twins) and
reference.twins.sampler.seed_int, and by the kernels through kernels.sampler.checks.seed_args.
For a base seed s < 2^63 and each of bits 32, 48, 63 the gate checks that s and s ^ 2^b

  (1) give different uniforms in the reference RNG (every purpose, positions 0 … P−1);
  (2) give different token streams through the engine (the twins on the CPU, the kernels on a
      GPU), and the same seed reproduces its stream bit for bit on a fresh engine;
  (3) are treated alike by the engine and the reference: the device state's int64 bits read
      back as the request seed through host_seed and seed_int, and the twins engine's tokens
      and round records equal the reference generator's (Precision "matched") for every seed —
      so a seed ≥ 2^63 is not reinterpreted on its way through the int64 bits.
A seed reduced to fewer bits anywhere makes two of these seeds collide in (1) or (2), or the
engine disagree with the reference in (3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qualification import device_engine, mini_engine
from reference.depth import FixedDepth
from reference.rng import Purpose, uniforms
from reference.speculative import GenerationRequest
from reference.twins.sampler import seed_int


@dataclass(frozen=True)
class SeedGateConfig:
    base_seed: int = 0x2545F4914F6CDD1D  # < 2^63: flipping bit 63 gives a seed ≥ 2^63
    bits: tuple[int, ...] = (32, 48, 63)
    rng_positions: int = 64
    prompt_tokens: int = 20
    new_tokens: int = 16
    depth: int = 3
    kind: str = "docstring"


def _hex(seed: int) -> str:
    return f"{seed:#018x}"


def rng_problems(g: SeedGateConfig, s: int, t: int) -> tuple[list[str], str]:
    """(problems, fact) of check (1) for seeds s, t."""
    pos = torch.arange(g.rng_positions, dtype=torch.int64)
    differ = sum(int((uniforms(s, pos, p) != uniforms(t, pos, p)).sum()) for p in Purpose)
    total = g.rng_positions * len(Purpose)
    if differ == 0:
        return [f"reference uniforms of {_hex(s)} and {_hex(t)} are identical at all {total} "
                "(position, purpose) counters"], ""
    return [], f"uniforms differ at {differ}/{total}"


def run(g: SeedGateConfig | None = None) -> tuple[bool, str, list[str]]:
    from iquestrt.live import host_seed
    from reference.model import ReferenceModel
    from reference.speculative import ReferenceGenerator

    g = g or SeedGateConfig()
    if not 0 <= g.base_seed < 2**63:
        raise ValueError(f"SeedGateConfig.base_seed must lie in [0, 2^63), got {g.base_seed}")
    ckpt = mini_engine.load_mini()
    (prompt,) = mini_engine.prompts(g.prompt_tokens, kinds=(g.kind,))
    policy = FixedDepth(g.depth)
    w = device_engine.weights(ckpt)
    w_twins = w if w.device.type == "cpu" else device_engine.weights(ckpt, "cpu")
    ref = ReferenceGenerator(ReferenceModel(ckpt.cfg, ckpt.dequantized(), "matched"), policy)
    seeds = [g.base_seed] + [g.base_seed ^ (1 << b) for b in g.bits]
    ev, streams = [], {}
    for s in seeds:
        req = GenerationRequest(prompt.ids, g.new_tokens, mini_engine.SAMPLING, s)
        eng = device_engine.engine(w, policy)
        streams[s] = device_engine.outcome(eng, req)
        bits = eng.session.device.seed  # [1] int64: the request seed's bits on the device
        back = (host_seed(bits), seed_int(bits))
        if back != (s, s):
            ev.append(f"seed {_hex(s)}: the device state's bits {int(bits[0])} read back as "
                      f"{_hex(back[0] % 2**64)} (host_seed) / {_hex(back[1])} (seed_int)")
        twin = streams[s] if eng.rcfg.ops == "twins" else device_engine.outcome(
            device_engine.engine(w_twins, policy), req)
        want = ref.generate(req)
        if (twin.tokens, twin.records) != (want.tokens, device_engine.record_key(want)):
            bad = device_engine.differences(
                twin, device_engine.Outcome(want.tokens, device_engine.record_key(want),
                                            want.stop_reason, twin.digest),
                " from the matched reference's")
            ev.append(f"seed {_hex(s)}: " + "; ".join(bad))
    again = device_engine.outcome(device_engine.engine(w, policy), GenerationRequest(
        prompt.ids, g.new_tokens, mini_engine.SAMPLING, g.base_seed))
    rep = device_engine.differences(again, streams[g.base_seed], " from the first run's")
    if rep:
        ev.append(f"seed {_hex(g.base_seed)} does not reproduce: " + "; ".join(rep))
    facts = []
    for b, t in zip(g.bits, seeds[1:], strict=True):
        probs, fact = rng_problems(g, g.base_seed, t)
        ev += probs
        i = mini_engine.first_difference(streams[g.base_seed].tokens, streams[t].tokens)
        if i is None:
            ev.append(f"bit {b}: seeds {_hex(g.base_seed)} and {_hex(t)} give the same "
                      f"{len(streams[t].tokens)} tokens through the engine")
        else:
            facts.append(f"bit {b} ({_hex(t)}): {fact}, tokens differ from token {i}")
    ok = not ev
    ev.append(f"{prompt.id}, {g.new_tokens} tokens at depth {g.depth} on "
              f"{device_engine.backend()[0]}; base seed {_hex(g.base_seed)}"
              + "".join(f"; {f}" for f in facts)
              + ("; every seed reproduces and equals the reference" if ok else ""))
    return ok, "exact" if ok else "differs", ev
