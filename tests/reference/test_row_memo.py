"""RowMemo (reference/row_memo.py): memoized matched rows give the plain model's bits, so gate 5b's
memoized draws equal plain per-request generation; a memo keyed too coarsely is noticed."""

import pytest
import torch

from qualification import distribution_e2e
from qualification.mini_engine import load_mini, prompts
from reference import row_memo
from reference.depth import FixedDepth
from reference.model import ReferenceModel
from reference.row_memo import MemoCache, RowMemo
from reference.speculative import GenerationRequest, ReferenceGenerator

SEEDS = 12
CFG = distribution_e2e.E2EConfig(n=SEEDS)


@pytest.fixture(scope="module")
def mini():
    ckpt = load_mini()
    return ckpt, ReferenceModel(ckpt.cfg, ckpt.dequantized(), "matched")


@pytest.fixture(scope="module")
def prompt():
    return prompts(CFG.prompt_tokens)[0].ids


@pytest.fixture(scope="module")
def plain(mini, prompt):
    """Each seed on its own: a fresh plain generator per request, nothing shared."""
    out = []
    for seed in range(SEEDS):
        gen = ReferenceGenerator(mini[1], FixedDepth(CFG.depth))
        out.append(gen.generate(GenerationRequest(prompt, CFG.horizon, CFG.sampling, seed)))
    return out


@pytest.mark.slow
def test_memoized_draws_equal_plain_requests(mini, prompt, plain):
    """Seed s runs after seeds 0 … s−1 have filled the memo, and gives the tokens it gives run
    first on the plain model. The seeds cover one-round and two-round requests (a rejection, then
    a round on rows the memo settled back)."""
    assert sorted({len(r.rounds) for r in plain}) == [1, 2]
    got = distribution_e2e.draws(mini[1], prompt, CFG)
    assert got == [tuple(r.tokens) for r in plain]


@pytest.mark.slow
def test_memoized_draws_in_reverse_order_equal_plain_requests(mini, prompt, plain):
    memo = RowMemo(mini[1])
    gen = ReferenceGenerator(memo, FixedDepth(CFG.depth))
    for seed in reversed(range(SEEDS)):
        req = GenerationRequest(prompt, CFG.horizon, CFG.sampling, seed)
        assert gen.generate(req).tokens == plain[seed].tokens, seed
    # every request after the first had its target prefill and draft catch-up (positions 1 … n−1)
    # from the memo
    assert memo.hits >= (SEEDS - 1) * (2 * len(prompt) - 1)


class _BlindToTheCache(RowMemo):
    def _key(self, kind, cache, tok, pos, h):
        return super()._key(kind, MemoCache(len(cache.k), cache.start), tok, pos, h)


class _BlindToHprev(RowMemo):
    def _key(self, kind, cache, tok, pos, h):
        return super()._key(kind, cache, tok, pos, None)


class _StoresViews(RowMemo):
    """Keeps views of the cache's K/V instead of copies."""

    def _compute(self, kind, cache, pos, tok, h):
        out = self.model.target(tok, pos, cache)
        n = len(cache.k)
        return row_memo._Row(len(self._rows), tuple(cache.k[i][-1:] for i in range(n)),
                             tuple(cache.v[i][-1:] for i in range(n)), out.logits, out.hidden)


def _confusions(memo: RowMemo, model: ReferenceModel, prompt) -> list[str]:
    """Rows asked of one memo in turn that share token and position but not the cache before
    them (target: the sequences differ one row earlier) or hprev (draft: the last row's hprev
    differs); the rows whose bits differ from the plain model's."""
    n, bad = 6, []
    toks, pos = torch.tensor(prompt[:n]), torch.arange(n)
    other = toks.clone()
    other[-2] = (other[-2] + 1) % model.cfg.target.vocab_size
    want = {name: model.target(seq, pos) for name, seq in (("prompt", toks), ("other", other))}
    assert not torch.equal(want["prompt"].logits[-1], want["other"].logits[-1])
    for name, seq in (("prompt", toks), ("other", other)):
        got = memo.target(seq, pos, memo.new_target_cache())
        if not torch.equal(got.logits, want[name].logits):
            bad.append(f"target after {name}")
    hidden = want["prompt"].hidden[: n - 1]  # [n−1, H]: hprev of positions 1 … n−1
    swapped = torch.cat([hidden[:-1], hidden[:1]])  # the last row's hprev replaced
    for name, h in (("target hidden", hidden), ("another hprev", swapped)):
        plain = model.draft(toks[1:], h, pos[1:], model.new_draft_cache())
        got = memo.draft(toks[1:], h, pos[1:], memo.new_draft_cache())
        if not torch.equal(got.logits, plain.logits):
            bad.append(f"draft on {name}")
    return bad


@pytest.mark.slow
def test_rows_are_keyed_by_the_cache_and_hprev(mini, prompt):
    """A memo is right only if its key holds all a row depends on; keys that leave out the
    cache or hprev return a row computed for another request, which this check notices."""
    model = mini[1]
    assert _confusions(RowMemo(model), model, prompt) == []
    assert _confusions(_BlindToTheCache(model), model, prompt) == ["target after other"]
    assert _confusions(_BlindToHprev(model), model, prompt) == ["draft on another hprev"]


def _caller_overwrites_then_asks_again(memo: RowMemo, model: ReferenceModel, prompt) -> bool:
    """A caller overwrites the logits, hidden rows and cache it got; True when a second request
    for the same rows still gets the plain model's bits, K/V included."""
    toks, pos = torch.tensor(prompt), torch.arange(len(prompt))
    want_cache = model.new_target_cache()
    want = model.target(toks, pos, want_cache)
    cache = memo.new_target_cache()
    out = memo.target(toks, pos, cache)
    assert torch.equal(out.logits, want.logits) and torch.equal(out.hidden, want.hidden)
    for t in (out.logits, out.hidden, *cache.k, *cache.v):
        t.fill_(7.0)
    cache2 = memo.new_target_cache()
    again = memo.target(toks, pos, cache2)
    assert memo.misses == len(prompt) and memo.hits == len(prompt)
    return (torch.equal(again.logits, want.logits) and torch.equal(again.hidden, want.hidden)
            and all(torch.equal(a, b) for a, b in zip(cache2.k + cache2.v,
                                                      want_cache.k + want_cache.v, strict=True)))


@pytest.mark.slow
def test_what_a_caller_holds_is_a_copy(mini, prompt):
    """The shared prefill stays as computed whatever a request does with its copy; a memo that
    stored views of a request's cache would hand later requests what that request wrote."""
    model = mini[1]
    assert _caller_overwrites_then_asks_again(RowMemo(model), model, prompt)
    assert not _caller_overwrites_then_asks_again(_StoresViews(model), model, prompt)


def test_memo_cache_keeps_ids_with_rows_and_refuses_foreign_rows(mini, prompt):
    model = mini[1]
    memo = RowMemo(model)
    cache = memo.new_target_cache()
    memo.target(torch.tensor(prompt[:5]), torch.arange(5), cache)
    copy = cache.clone()
    cache.truncate(3)
    assert len(cache.row_ids) == cache.length == 3 and copy.row_ids[:3] == cache.row_ids
    assert len(copy.row_ids) == copy.length == 5
    with pytest.raises(ValueError, match="cache expects 3"):
        memo.target(torch.tensor(prompt[:1]), torch.tensor([4]), cache)
    model.target(torch.tensor(prompt[3:4]), torch.tensor([3]), cache)  # behind the memo's back
    with pytest.raises(ValueError, match="written only by its RowMemo"):
        memo.target(torch.tensor(prompt[4:5]), torch.tensor([4]), cache)
    with pytest.raises(ValueError, match="written only by its RowMemo"):
        memo.target(torch.tensor(prompt[:1]), torch.tensor([0]), model.new_target_cache())


def test_other_precisions_are_refused(mini):
    ckpt = mini[0]
    with pytest.raises(ValueError, match="only 'matched'"):
        RowMemo(ReferenceModel(ckpt.cfg, ckpt.dequantized(), "bf16-fold"))
    assert isinstance(RowMemo(mini[1]).new_draft_cache(), MemoCache)
