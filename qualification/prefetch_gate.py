"""Gate 3d: expert prefetch changes no bit. The mini model (which ships a predictor) decodes one
request with prefetch on and off; tokens, round records and what every cache holds must agree.

On a GPU (ops "kernels") the prefetch kernels really run at 4–5 live rows — the verification width
of depth 3 — and warm predicted experts' weights. On the CPU the twins have no cache to warm and
the prefetcher stays idle, so there the gate proves only that the wiring (predictor loading, the
call before each sliding layer) leaves decoding alone; its negative control shows that a
prefetcher that did reach routing is caught by exactly this comparison.
"""

from __future__ import annotations

import torch

from iquestrt.snapshot import caches_digest
from qualification.mini_engine import MINI, RING_PAD, SAMPLING, first_difference, prompts
from reference.depth import FixedDepth
from reference.speculative import GenerationRequest

PROMPT_TOKENS, NEW_TOKENS, DEPTH, SEED = 64, 24, 3, 0


def _decode(prefetch: bool):
    from iquestrt.config import RuntimeConfig
    from iquestrt.engine import Engine

    gpu = torch.cuda.is_available()
    rcfg = RuntimeConfig(ops="kernels" if gpu else "twins", device="cuda" if gpu else "cpu",
                         ring_pad=RING_PAD, max_positions=512, policy=FixedDepth(DEPTH),
                         prefetch=prefetch)
    eng = Engine.from_checkpoint(MINI, rcfg)
    if prefetch and eng.target.prefetcher is None:
        raise FileNotFoundError(f"{MINI}/prefetch: the mini model's predictor is missing")
    req = GenerationRequest(prompts(PROMPT_TOKENS)[0].ids, NEW_TOKENS, SAMPLING, SEED)
    res = eng.generate(req)
    records = [(r.position, [d.token for d in r.drafts], r.accepted, r.emitted)
               for r in res.rounds]
    return res.tokens, records, caches_digest(eng.session.caches), eng.target.prefetcher


def run() -> tuple[bool, str, list[str]]:
    on_tokens, on_rec, on_dig, pre = _decode(True)
    off_tokens, off_rec, off_dig, _ = _decode(False)
    launched = "kernels launched" if pre.launch else "prefetcher idle (twins: no cache to warm)"
    evidence = [f"mini, {NEW_TOKENS} tokens at depth {DEPTH} ({len(on_rec)} rounds), prefetch "
                f"on: {launched}"]
    if on_tokens != off_tokens:
        evidence.append(f"tokens differ at {first_difference(on_tokens, off_tokens)}")
    elif on_rec != off_rec:
        evidence.append(f"round records differ at round {first_difference(on_rec, off_rec)}")
    elif on_dig != off_dig:
        evidence.append("cache contents differ")
    else:
        evidence.append("tokens, round records and cache contents equal with prefetch on and off")
        return True, "exact", evidence
    return False, "differs", evidence
