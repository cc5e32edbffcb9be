"""The two draft conventions of DraftConfig (docs/public_conventions.md): the RoPE position of a
draft row (draft_position_offset) and how the draft cache is settled after verification
(draft_kv_settle), in the reference generator and in the runtime engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qualification import engine_cache_gate, mini_engine
from reference.config import ModelConfig, preset
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, generate
from reference.synthetic import synthetic_params

SAMPLING = mini_engine.SAMPLING


def _tiny(offset: int, settle: str) -> tuple[ModelConfig, dict]:
    cfg = preset("tiny")
    draft = dataclasses.replace(cfg.draft, draft_position_offset=offset, draft_kv_settle=settle)
    cfg = dataclasses.replace(cfg, draft=draft)
    return cfg, synthetic_params(cfg, 3)


def test_the_offset_is_a_rope_shift_only():
    """Offset −1 at positions p equals offset 0 at p − 1 (scores and windows depend on position
    differences; only RoPE sees the offset), and differs from offset 0 at p: the sink's logit
    depends on the query's absolute rotation."""
    (cfg1, params), (cfg0, _) = _tiny(-1, "keep"), _tiny(0, "keep")
    shifted, plain = ReferenceModel(cfg1, params, "fp32"), ReferenceModel(cfg0, params, "fp32")
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg0.target.vocab_size, (5,), generator=g)
    h = torch.randn(5, cfg0.target.hidden_size, generator=g).bfloat16().float()
    pos = torch.arange(20, 25)
    a = shifted.draft(tok, h, pos, None)
    assert torch.equal(a.logits, plain.draft(tok, h, pos - 1, None).logits)
    assert not torch.equal(a.logits, plain.draft(tok, h, pos, None).logits)


@pytest.mark.parametrize("settle", ["keep", "recompute"])
@pytest.mark.slow
def test_depth_zero_rows_per_round(settle):
    """keep: depth 0 runs 1 row, or 2 after a round that accepted every draft; recompute: a+1
    rows (the previous round's accepted drafts and the new token), from the target's hidden."""
    cfg, params = _tiny(0, settle)
    model = ReferenceModel(cfg, params, "fp32")
    rows, real = [], model.draft
    model.draft = lambda tok, h, pos, cache: rows.append(len(pos)) or real(tok, h, pos, cache)
    depth = 3
    res = generate(model, GenerationRequest(tuple(range(1, 12)), 40, SAMPLING, 2), depth=depth)
    firsts = [rows[i] for i in range(0, len(rows), depth)]  # each round: depth 0, then 2 more
    assert len(rows) == depth * len(res.rounds)
    want = [11] + [(r.accepted + 1 if settle == "recompute" else 1 + (r.accepted == depth))
                   for r in res.rounds[:-1]]
    assert firsts == want
    assert {r.accepted for r in res.rounds} - {0}  # some round accepted, so the rules differ


@pytest.mark.slow
def test_engine_matches_the_reference_under_the_public_conventions():
    """Gate 4b's second run (qualify runs it at full length) on the mini weights: tokens, rounds
    and every cache row bit-identical with the matched reference; the committed draft rows equal
    a fresh prefill's."""
    g = engine_cache_gate.EngineCacheGateConfig(new_tokens=16)
    ckpt = engine_cache_gate.with_conventions(mini_engine.load_mini(), -1, "recompute")
    ok, ev = engine_cache_gate.run_convention(g, ckpt)
    assert ok, ev
