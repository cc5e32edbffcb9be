"""training/model.py (batched, differentiable) vs reference/model.py (FP32), same weights.

The draft reference is inference itself under teacher forcing: depth 0 runs the catch-up rows
1 … T−1 into the draft cache; for every round position m the cache is rolled back to m and
depths 1 … D−1 run one row each at m+1 … (reference/speculative.py's drafting loop). The
training model computes all of that in one pass per depth; rows must agree within the
training.* rows of qualification/tolerances.py, and each broken variant below must not.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import training.model as tm
from qualification.tolerances import check, measure, tolerance
from reference.config import preset
from reference.model import ReferenceModel
from reference.synthetic import synthetic_params
from training.model import TrainModel

B, T = 2, 24  # T > tiny's target window 16 and draft window 8, so both windows bind
SEEDS = (0, 1)


def _reference(cfg, params, tokens):
    """Target logits [B, T, V] and per-depth draft logits [B, T, V] (NaN where undefined)."""
    ref = ReferenceModel(cfg, params, "fp32")
    depths, v = cfg.draft.num_draft_slots, cfg.target.vocab_size
    target = torch.empty(B, T, v)
    draft = [torch.full((B, T, v), float("nan")) for _ in range(depths)]
    for b in range(B):
        out = ref.target(tokens[b], torch.arange(T))
        target[b] = out.logits
        cache = ref.new_draft_cache()
        d0 = ref.draft(tokens[b, 1:], out.hidden[:-1], torch.arange(1, T), cache)
        draft[0][b, 1:] = d0.logits
        for m in range(1, T - 1):
            round_cache = cache.clone()
            round_cache.truncate(m + 1)  # depth-0 rows 1 … m
            h = d0.hidden[m - 1 : m]
            for j in range(1, min(depths, T - m)):
                row = ref.draft(tokens[b, m + j : m + j + 1], h, torch.tensor([m + j]), round_cache)
                draft[j][b, m + j] = row.logits[0]
                h = row.hidden
    return target, draft


@pytest.fixture(scope="module", params=SEEDS)
def case(request):
    cfg = preset("tiny")
    params = synthetic_params(cfg, request.param)
    gen = torch.Generator().manual_seed(100 + request.param)
    tokens = torch.randint(0, cfg.target.vocab_size, (B, T), generator=gen)
    return cfg, params, tokens, *_reference(cfg, params, tokens)


def _train_logits(cfg, params, tokens):
    model = TrainModel(cfg, params)
    with torch.no_grad():
        out = model.target(tokens)
        return out.logits, model.draft(tokens, out.hidden, cfg.draft.num_draft_slots).logits


def _defined(draft):
    """Concatenate each depth j's defined rows p ≥ j+1 into one [rows, V] tensor."""
    return torch.cat([d[:, j + 1 :].reshape(-1, d.shape[-1]) for j, d in enumerate(draft)])


def test_target_logits_match_reference(case):
    cfg, params, tokens, ref_target, _ = case
    target, _ = _train_logits(cfg, params, tokens)
    print(check(target, ref_target, "training.target_vs_reference", "fp32"))


def test_recursive_draft_logits_match_reference(case):
    cfg, params, tokens, _, ref_draft = case
    _, draft = _train_logits(cfg, params, tokens)
    assert len(draft) == cfg.draft.num_draft_slots
    expected = _defined(ref_draft)
    assert torch.isfinite(expected).all()  # every defined row has a reference value
    print(check(_defined(draft), expected, "training.draft_vs_reference", "fp32"))


def _replace(cfg, part, **kw):
    return dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **kw)})


def test_broken_variants_exceed_their_rows(case, monkeypatch):
    cfg, params, tokens, ref_target, ref_draft = case
    t, d = cfg.target, cfg.draft
    target_mutants = {
        "target window + 1": _replace(cfg, "target", sliding_window=t.sliding_window + 1),
        "sink dropped": _replace(cfg, "target", attention_sink=False),
    }
    draft_mutants = {
        "draft window + 1": _replace(cfg, "draft", sliding_window=d.sliding_window + 1),
        "draft RoPE base": _replace(cfg, "draft", swa_rope_theta=t.rope_theta),
    }
    row_t = tolerance("training.target_vs_reference", "fp32")
    row_d = tolerance("training.draft_vs_reference", "fp32")
    for name, mutant in target_mutants.items():
        target, _ = _train_logits(mutant, params, tokens)
        m = measure(target, ref_target, row_t)
        assert not m.ok, f"{name} passes the target row: {m}"
    for name, mutant in draft_mutants.items():
        _, draft = _train_logits(mutant, params, tokens)
        m = measure(_defined(draft), _defined(ref_draft), row_d)
        assert not m.ok, f"{name} passes the draft row: {m}"

    diagonal = tm._diagonal_keys
    patches = {
        "hprev not shifted": ("_shift", lambda h: h),
        "deeper keys replaced by depth-0 keys": (
            "_diagonal_keys", lambda kv, j, w, dev: diagonal([kv[0]] * len(kv), j, w, dev)
        ),
    }
    for name, (attr, fake) in patches.items():
        with monkeypatch.context() as mp:
            mp.setattr(tm, attr, fake)
            _, draft = _train_logits(cfg, params, tokens)
        m = measure(_defined(draft), _defined(ref_draft), row_d)
        assert not m.ok, f"{name} passes the draft row: {m}"
