"""Gate 3c — padded vs exact width: the engine's results do not depend on its padding rows.

Every op runs on a buffer of max_width rows of which the first n are live; padding rows hold
whatever the buffer held and must never reach a live row. Two twins engines on the trained mini
model — width 8 (FixedDepth(3) verifies 4 rows: 4 padding rows every round) and the exact width 4
(none) — must agree bit for bit on:
  * the prefill logits of a prompt of 20 tokens (a multiple of 4, not of 8: the last width-8
    chunk holds 4 padding rows, no width-4 chunk does);
  * a sampled generation: tokens and every round record (position, drafts with q(token) and
    entropy, accepted, emitted, bonus). The last verification row only survives a round whose
    drafts are all accepted, so the evidence counts those rounds.
Exact: the twins compute one row at a time, so no legitimate difference exists.

Dimension letters: T prompt tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qualification import mini_engine
from reference.speculative import GenerationRequest


@dataclass(frozen=True)
class WidthGateConfig:
    prompt_tokens: int = 20
    new_tokens: int = 24
    depth: int = 3
    widths: tuple[int, int] = (8, 4)  # padded, exact (= depth + 1)
    seed: int = 3
    kind: str = "docstring"


def record_key(res) -> list:
    return [(r.position, [(d.token, d.prob, d.entropy) for d in r.drafts], r.accepted,
             r.emitted, r.bonus) for r in res.rounds]


def run(g: WidthGateConfig | None = None) -> tuple[bool, str, list[str]]:
    g = g or WidthGateConfig()
    ckpt = mini_engine.load_mini()
    (prompt,) = mini_engine.prompts(g.prompt_tokens, kinds=(g.kind,))
    req = GenerationRequest(prompt.ids, g.new_tokens, mini_engine.SAMPLING, g.seed)
    logits, results = [], []
    for w in g.widths:
        eng = mini_engine.engine(ckpt, g.depth, max_width=w)
        logits.append(eng.prefill_logits(list(prompt.ids))[0])  # [T, V]
        results.append(eng.generate(req))
    (pw, ew), ev = g.widths, []
    if not torch.equal(*logits):
        bad = (logits[0] != logits[1]).any(-1).nonzero().flatten().tolist()
        ev.append(f"prefill logits differ at positions {bad[:5]} (width {pw} vs {ew})")
    (a, b) = results
    if a.tokens != b.tokens:
        i = mini_engine.first_difference(a.tokens, b.tokens)
        ev.append(f"tokens differ (first at token {i})")
    ka, kb = record_key(a), record_key(b)
    if ka != kb:
        i = mini_engine.first_difference(ka, kb)
        ev.append(f"round records differ from round {i} on (width {pw}: {len(ka)} rounds, "
                  f"width {ew}: {len(kb)})")
    ok = not ev
    full = sum(r.accepted == len(r.drafts) for r in a.rounds)
    ev.append(f"{prompt.id}, last {g.prompt_tokens} tokens; {len(a.rounds)} rounds, {full} with "
              f"every draft accepted" + (f"; width {pw} == width {ew} bit for bit (prefill "
                                         "logits, tokens, records)" if ok else ""))
    return ok, "exact", ev
