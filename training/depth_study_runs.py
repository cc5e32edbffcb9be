"""Decoding for the depth study (training/depth_study.py): every (prompt, seed) pair under
every policy with one request object.

Matched mode evaluates every row on its own, so a prompt's prefill rows do not depend on what
follows; `SharedPrefill` computes them once per prompt and copies them into later requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from reference.model import KVCache, Output, ReferenceModel
from reference.speculative import GenerationRequest, GenerationResult, ReferenceGenerator
from training.depth_study_prompts import Prompt


class SharedPrefill:
    """A matched ReferenceModel that computes each prompt's target prefill (rows 0 … n−1) and
    the draft catch-up rows 1 … n−1 once, then copies them into an empty cache."""

    def __init__(self, model: ReferenceModel):
        if not model.precision.matched:
            raise ValueError(f"SharedPrefill: needs Precision 'matched' (rows computed one at a "
                             f"time), got {model.precision.name!r}")
        self.model, self.cfg, self.hits = model, model.cfg, 0
        self._target: dict[tuple, tuple[Output, KVCache]] = {}
        self._draft: dict[tuple, tuple[torch.Tensor, Output, KVCache]] = {}

    def new_target_cache(self) -> KVCache:
        return self.model.new_target_cache()

    def new_draft_cache(self) -> KVCache:
        return self.model.new_draft_cache()

    @staticmethod
    def _fill(cache: KVCache, stored: KVCache) -> None:
        cache.k = [None if t is None else t.clone() for t in stored.k]
        cache.v = [None if t is None else t.clone() for t in stored.v]

    def target(self, tokens, positions, cache=None) -> Output:
        if cache is None or cache.length or int(positions[0]) != cache.start:
            return self.model.target(tokens, positions, cache)
        key = tuple(tokens.tolist())
        if key in self._target:
            self.hits += 1
        else:
            c = self.new_target_cache()
            self._target[key] = (self.model.target(tokens, positions, c), c)
        out, stored = self._target[key]
        self._fill(cache, stored)
        return Output(out.logits.clone(), out.hidden.clone())

    def draft(self, tokens, hprev, positions, cache=None) -> Output:
        # the last catch-up row holds the first sampled token (seed-dependent): never shared
        if cache is None or cache.length or int(positions[0]) != cache.start or len(tokens) < 2:
            return self.model.draft(tokens, hprev, positions, cache)
        key = tuple(tokens[:-1].tolist())
        hit = self._draft.get(key)
        if hit is not None and torch.equal(hit[0], hprev[:-1]):
            self.hits += 1
            self._fill(cache, hit[2])
            head = hit[1]
        else:
            head = self.model.draft(tokens[:-1], hprev[:-1], positions[:-1], cache)
            self._draft[key] = (hprev[:-1].clone(), head, cache.clone())
        last = self.model.draft(tokens[-1:], hprev[-1:], positions[-1:], cache)
        return Output(torch.cat([head.logits, last.logits]), torch.cat([head.hidden, last.hidden]))


def decode(model, policy, req: GenerationRequest) -> GenerationResult:
    return ReferenceGenerator(model, policy).generate(req)


def run_pairs(model, prompts: Sequence[Prompt], seeds: Sequence[int], policies: dict,
              sampling, new_tokens: int, log: Callable[[str], None] = print,
              run: Callable = decode) -> tuple[list[dict], list[GenerationResult]]:
    """Every (prompt, seed) decoded by every policy with one request object → per-run rows
    (depths d and accepted a of each round) and the results, in (prompt, seed, policy) order."""
    rows, results, t0 = [], [], time.process_time()
    total, i = len(prompts) * len(seeds) * len(policies), 0
    for p in prompts:
        for s in seeds:
            req = GenerationRequest(p.ids, new_tokens, sampling, s)
            for label, pol in policies.items():
                res = run(model, pol, req)
                d = [len(r.drafts) for r in res.rounds]
                a = [r.accepted for r in res.rounds]
                rows.append({"prompt": p.id, "seed": s, "policy": label,
                             "depths": "".join(map(str, d)), "accepted": "".join(map(str, a))})
                results.append(res)
                i += 1
                log(f"[{i}/{total}] {p.id} seed {s} {label}: {len(d)} rounds, "
                    f"{(sum(a) + len(a)) / len(a):.2f} tokens/round, cpu "
                    f"{time.process_time() - t0:.0f}s")
    return rows, results
