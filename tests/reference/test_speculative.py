"""The reference generate() loop: drafting, verification bookkeeping, settlement of both caches.

A Markov toy model with the ReferenceModel interface makes acceptance controllable (a draft equal
to the target accepts everything at temperature 0) and makes cache contents checkable: each cache
row stores the token of its position, so a cache after generation must hold exactly the
committed tokens — nothing rejected survives.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from reference.config import DraftConfig, SamplingDefaults, preset
from reference.depth import FixedDepth
from reference.model import KVCache, Output, ReferenceModel
from reference.speculative import GenerationRequest, ReferenceGenerator, generate
from reference.synthetic import synthetic_params

GREEDY = SamplingDefaults(temperature=0.0, top_k=0, top_p=1.0)
V = 12


@dataclass(frozen=True)
class _T:
    vocab_size: int = V
    max_position_embeddings: int = 4096
    num_hidden_layers: int = 1


@dataclass(frozen=True)
class _Cfg:
    target: _T = _T()
    # the toy caches' expectations are written for "keep" (tests/reference/test_draft_conventions.py
    # covers "recompute")
    draft: DraftConfig = DraftConfig(draft_position_offset=0, draft_kv_settle="keep")


class MarkovModel:
    """Logits of a row depend only on its token (target table A, draft table B). Cache rows
    store the token id so tests can read back what each cache holds."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.cfg = _Cfg()
        self.a, self.b = a, b  # [V, V] logits of next token given current token

    def _rows(self, table, tokens, positions, cache):
        if cache is not None:
            expected = cache.start + len(cache.positions(0))
            assert int(positions[0]) == expected, (int(positions[0]), expected)
            kv = tokens.float()[:, None, None]  # [R, 1, 1]
            cache.append(0, kv, kv)
        return Output(table[tokens].clone(), torch.nn.functional.one_hot(tokens, V).float())

    def target(self, tokens, positions, cache=None):
        return self._rows(self.a, tokens, positions, cache)

    def draft(self, tokens, hprev, positions, cache=None):
        assert hprev.shape == (tokens.shape[0], V)
        return self._rows(self.b, tokens, positions, cache)

    def new_target_cache(self):
        return KVCache(1, start=0)

    def new_draft_cache(self):
        return KVCache(1, start=1)


def _tables(seed: int, same: bool):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(V, V, generator=g) * 2
    b = a.clone() if same else a + torch.randn(V, V, generator=g) * 1.5
    return a, b


class _Spy(ReferenceGenerator):
    """Keeps the caches of the last generate() for inspection."""

    def generate(self, req, on_round=None):
        made = []
        orig_t, orig_d = self.model.new_target_cache, self.model.new_draft_cache
        self.model.new_target_cache = lambda: made.append(orig_t()) or made[-1]
        self.model.new_draft_cache = lambda: made.append(orig_d()) or made[-1]
        try:
            res = super().generate(req, on_round)
        finally:
            self.model.new_target_cache, self.model.new_draft_cache = orig_t, orig_d
        self.tcache, self.dcache = made
        return res


def _cache_tokens(cache: KVCache) -> list[int]:
    k = cache.k[0]
    return [] if k is None else [int(x) for x in k[:, 0, 0]]


@pytest.mark.parametrize("depth", [1, 3, 7])
def test_identical_draft_accepts_everything_greedy(depth):
    a, b = _tables(0, same=True)
    gen = _Spy(MarkovModel(a, b), FixedDepth(depth))
    res = gen.generate(GenerationRequest((1, 2), 40, GREEDY, seed=3))
    full = [r for r in res.rounds if len(r.emitted) == depth + 1]
    assert len(full) == len(res.rounds) - 1  # every round but the budget-trimmed last
    assert all(r.accepted == depth and r.bonus for r in res.rounds[:-1])
    plain = generate(MarkovModel(a, b), GenerationRequest((1, 2), 40, GREEDY, seed=3), depth=0)
    assert res.tokens == plain.tokens


@pytest.mark.parametrize("depth", [1, 2, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_caches_hold_exactly_the_committed_tokens(depth, seed):
    a, b = _tables(seed, same=False)
    gen = _Spy(MarkovModel(a, b), FixedDepth(depth))
    prompt = (3, 1, 4)
    res = gen.generate(GenerationRequest(prompt, 60, SamplingDefaults(1.0, 0, 1.0), seed=seed))
    seq = list(prompt) + res.tokens
    assert any(0 < r.accepted for r in res.rounds), "the case must exercise accepted drafts"
    assert any(r.accepted < len(r.drafts) for r in res.rounds), "and rejections"
    # target cache: every committed position but the newest token (never yet verified)
    tc = _cache_tokens(gen.tcache)
    assert tc == seq[:-1]
    # draft cache: positions 1 … with the committed token of each position
    dc = _cache_tokens(gen.dcache)
    assert dc == seq[1 : 1 + len(dc)]
    assert len(dc) <= len(tc)


def test_round_records_are_consistent():
    a, b = _tables(4, same=False)
    res = generate(
        MarkovModel(a, b), GenerationRequest((5,), 80, SamplingDefaults(1.0, 0, 1.0), 11), depth=4
    )
    assert sum(len(r.emitted) for r in res.rounds) + 1 == len(res.tokens)
    for r in res.rounds[:-1]:
        assert len(r.drafts) == 4
        assert r.emitted[: r.accepted] == [d.token for d in r.drafts[: r.accepted]]
        assert len(r.emitted) == r.accepted + 1
        assert r.bonus == (r.accepted == 4)
        assert all(0 < d.prob <= 1 for d in r.drafts)
    positions = [r.position for r in res.rounds]
    steps = [len(r.emitted) for r in res.rounds[:-1]]
    assert [q - p for p, q in zip(positions, positions[1:], strict=False)] == steps


def test_stop_token_ends_and_is_emitted():
    a, b = _tables(5, same=True)
    model = MarkovModel(a, b)
    free = generate(model, GenerationRequest((1,), 30, GREEDY, 0), depth=3).tokens
    stop = free[4]
    res = generate(model, GenerationRequest((1,), 30, GREEDY, 0, stop_ids=(stop,)), depth=3)
    assert res.stop_reason == "stop"
    assert res.tokens == free[: free.index(stop) + 1]


@pytest.mark.parametrize(
    "req, message",
    [
        (GenerationRequest((), 4, GREEDY, 0), "prompt_ids"),
        (GenerationRequest((1, V), 4, GREEDY, 0), "prompt_ids"),
        (GenerationRequest((1,), 0, GREEDY, 0), "max_new_tokens"),
        (GenerationRequest((1,), 5000, GREEDY, 0), "max_position_embeddings"),
        (GenerationRequest((1,), 4, GREEDY, 0, stop_ids=(V + 3,)), "stop_ids"),
        (GenerationRequest((1,), 4, GREEDY, -1), "seed"),
        (GenerationRequest((1,), 4, SamplingDefaults(-1.0, 0, 1.0), 0), "temperature"),
        (GenerationRequest((1,), 4, SamplingDefaults(1.0, V + 1, 1.0), 0), "top_k"),
        (GenerationRequest((1,), 4, SamplingDefaults(1.0, 0, 0.0), 0), "top_p"),
    ],
)
def test_bad_requests_name_the_problem(req, message):
    a, b = _tables(0, same=True)
    with pytest.raises(ValueError, match=message):
        generate(MarkovModel(a, b), req, depth=2)


# --- the real reference model on the tiny preset -------------------------------------------


@pytest.fixture(scope="module")
def tiny_fp32():
    cfg = preset("tiny")
    return ReferenceModel(cfg, synthetic_params(cfg, 0), "fp32")


@pytest.mark.parametrize("depth", [1, 4])
@pytest.mark.slow
def test_tiny_greedy_speculative_equals_plain(tiny_fp32, depth):
    req = GenerationRequest((1, 2, 3, 4, 5, 6), 40, GREEDY, 0)
    assert generate(tiny_fp32, req, depth=depth).tokens == generate(tiny_fp32, req).tokens


@pytest.mark.slow
def test_tiny_sampling_is_reproducible(tiny_fp32):
    req = GenerationRequest((9, 8, 7), 30, SamplingDefaults(), 123)
    r1, r2 = generate(tiny_fp32, req, depth=3), generate(tiny_fp32, req, depth=3)
    assert r1.tokens == r2.tokens
    assert [r.accepted for r in r1.rounds] == [r.accepted for r in r2.rounds]
    other = generate(tiny_fp32, GenerationRequest((9, 8, 7), 30, SamplingDefaults(), 124), depth=3)
    assert other.tokens != r1.tokens


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.slow
def test_tiny_generates_200_tokens(precision):
    cfg = preset("tiny")
    model = ReferenceModel(cfg, synthetic_params(cfg, 1), precision)
    res = generate(model, GenerationRequest((1, 2, 3), 200, SamplingDefaults(), 5), depth=3)
    assert len(res.tokens) == 200
    assert all(0 <= t < cfg.target.vocab_size for t in res.tokens)
    assert len(set(res.tokens)) > 10  # sampling with real entropy, not a collapsed model
