"""Gate 6 — the production sampler (kernels/sampler/) against the pinned semantics.

Checks, all exact (token ids and served candidates are compared with torch.equal):
  sharded    — N virtual ranks (N = 2, 4, 8; unequal shards when V % N ≠ 0) give the bits of the
               unsharded sampler, with tied logits planted across shard boundaries;
  semantics  — the served candidate ids and order equal reference.sampling.served_candidates
               (ties at the top-k boundary by lower index; the token crossing top-p kept;
               top-k before top-p; temperature);
  rng        — the same (seed, position, purpose) draws the same token on a rerun; the token
               of a row depends on its position (a sampler keyed without position fails this).
Runs on the GPU when present, otherwise under the Triton interpreter at a small vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qualification.tolerances import measure, tolerance
from reference.config import SamplingDefaults
from reference.rng import Purpose
from reference.sampling import served_candidates


@dataclass(frozen=True)
class SamplerGateConfig:
    vocab: int = 1003  # odd: shards of unequal size
    rows: int = 8
    seed: int = 20261129
    settings: tuple[SamplingDefaults, ...] = (
        SamplingDefaults(1.0, 20, 0.95),
        SamplingDefaults(0.7, 8, 0.9),
        SamplingDefaults(1.3, 64, 1.0),
        SamplingDefaults(0.0, 20, 0.95),
    )


def _logits(g: SamplerGateConfig, device, gen) -> torch.Tensor:
    x = torch.randn(g.rows, g.vocab, generator=gen) * 3  # [R, V]
    # plant ties straddling shard boundaries: equal top logits at ids on both sides of a cut
    for r in range(g.rows):
        cut = (r % 7 + 1) * g.vocab // 8  # a boundary between shards of the 8-way split
        x[r, cut - 1] = x[r, cut] = x[r].max() + 0.5
    return x.to(device)


def run(g: SamplerGateConfig | None = None) -> tuple[bool, list[str]]:
    from kernels.sampler import sample  # after TRITON_INTERPRET is decided by the caller

    g = g or SamplerGateConfig()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(g.seed)
    evidence, ok = [], True
    pos = torch.arange(100, 100 + g.rows, device=dev)
    for s in g.settings:
        logits = _logits(g, dev, gen)
        base = sample(logits, s, g.seed, pos)
        for n in (2, 4, 8):
            sh = sample(logits, s, g.seed, pos, shards=n)
            same = all(torch.equal(a, b) for a, b in zip(base, sh, strict=True))
            ok &= same
            if not same:
                evidence.append(f"{s}: {n} shards differ from unsharded")
        ref_ids, ref_p = served_candidates(logits.cpu(), s)
        w = base.ids.shape[1]
        kept = ref_p[:, :w] > 0
        got = torch.where(kept, base.ids.cpu(), -1)
        want = torch.where(kept, ref_ids[:, :w], -1)
        if not torch.equal(got, want):
            ok = False
            bad = int((got != want).any(1).nonzero()[0])
            evidence.append(f"{s}: served candidates differ from the reference at row {bad}")
        elif s.temperature > 0:  # probabilities: exp is the one step not pinned to the bit
            m = measure(base.probs.cpu(), ref_p[:, :w], tolerance("kernels.sampler.probs", "fp32"))
            if not m.ok:
                ok = False
                evidence.append(f"{s}: served probabilities: {m}")
        again = sample(logits, s, g.seed, pos)
        if not torch.equal(again.tokens, base.tokens):
            ok = False
            evidence.append(f"{s}: rerun drew different tokens")
    flat = torch.zeros(g.rows, g.vocab, device=dev)  # uniform rows: only the uniform decides
    s = SamplingDefaults(1.0, 64, 1.0)
    same_pos = sample(flat, s, g.seed, torch.full((g.rows,), 7, device=dev))
    by_pos = sample(flat, s, g.seed, torch.arange(g.rows, device=dev))
    other = sample(flat, s, g.seed, torch.arange(g.rows, device=dev), Purpose.DRAFT_SAMPLE)
    if len(set(same_pos.tokens.tolist())) != 1 or len(set(by_pos.tokens.tolist())) < 4:
        ok = False
        evidence.append(f"rng: position keying broken: {by_pos.tokens.tolist()}")
    if torch.equal(other.tokens, by_pos.tokens):
        ok = False
        evidence.append("rng: purpose does not change the draw")
    evidence.append(
        f"{len(g.settings)} settings x shards (2, 4, 8) at V={g.vocab}, R={g.rows} on {dev.type}: "
        + ("sharded == unsharded, candidates == reference, reruns identical" if ok else "FAILED")
    )
    return ok, evidence
