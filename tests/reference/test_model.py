"""reference/model.py self-consistency on the tiny preset: verify vs decode, cache vs no-cache
recompute, rollback, sliding-window reach per layer, and the sink in every layer and the draft.
"""

import pytest
import torch

from qualification.tolerances import check
from reference import ops
from reference.config import FULL, SLIDING, preset
from reference.model import KVCache, ReferenceModel
from reference.synthetic import synthetic_params
from tests.helpers.oracles import torch_threads

CFG = preset("tiny")
T = 40  # sequence length used below; > target window 16 and draft window 8
PREFIX = 20


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def params():
    return synthetic_params(CFG, 0)


@pytest.fixture(scope="module")
def models(params):
    return {p: ReferenceModel(CFG, params, p) for p in ("fp32", "bf16")}


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, CFG.target.vocab_size, (T,), generator=torch.Generator().manual_seed(5))


def pos(a: int, b: int) -> torch.Tensor:
    return torch.arange(a, b)


def prefill(m: ReferenceModel, tokens, n: int) -> KVCache:
    c = m.new_target_cache()
    m.target(tokens[:n], pos(0, n), c)
    return c


def decode_rows(m, tokens, a: int, b: int, cache):
    outs = [m.target(tokens[i : i + 1], pos(i, i + 1), cache) for i in range(a, b)]
    if not outs:
        return None, None
    return torch.cat([o.logits for o in outs]), torch.cat([o.hidden for o in outs])


def widen_window(monkeypatch, by: int = 1):
    real = ops.visible
    monkeypatch.setattr(ops, "visible", lambda q, k, w: real(q, k, None if w is None else w + by))


def caches_equal(a: KVCache, b: KVCache) -> bool:
    return (
        a.start == b.start and a.next_position == b.next_position
        and all(torch.equal(x, y) for x, y in zip(a.k, b.k, strict=True))
        and all(torch.equal(x, y) for x, y in zip(a.v, b.v, strict=True))
    )


# --- verify rows vs one-by-one decode --------------------------------------------------------


@pytest.fixture(scope="module")
def decoded(models, tokens):
    """Per mode: the cache after prefilling PREFIX tokens, and rows PREFIX … PREFIX+7 decoded
    one at a time (logits [8, V], hidden [8, H])."""
    out = {}
    for prec, m in models.items():
        c = prefill(m, tokens, PREFIX)
        out[prec] = (c.clone(), *decode_rows(m, tokens, PREFIX, PREFIX + 8, c))
    return out


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
@pytest.mark.parametrize("rows", range(1, 9))
def test_verify_equals_decode(models, tokens, decoded, prec, rows):
    m = models[prec]
    c_prefill, d_logits, d_hidden = decoded[prec]
    c = c_prefill.clone()
    v = m.target(tokens[PREFIX : PREFIX + rows], pos(PREFIX, PREFIX + rows), c)
    print(check(v.logits, d_logits[:rows], "reference.verify_vs_decode", prec))
    check(v.hidden.float(), d_hidden[:rows].float(), "reference.verify_vs_decode", prec)
    assert c.next_position == PREFIX + rows


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_verify_check_catches_window_plus_one(models, tokens, decoded, prec, monkeypatch):
    m = models[prec]
    c_prefill, d_logits, _ = decoded[prec]
    widen_window(monkeypatch)
    v = m.target(tokens[PREFIX : PREFIX + 4], pos(PREFIX, PREFIX + 4), c_prefill.clone())
    with pytest.raises(AssertionError):
        check(v.logits, d_logits[:4], "reference.verify_vs_decode", prec)


# --- cached decoding vs a no-cache pass over the whole sequence -----------------------------


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_target_cache_matches_recompute(models, tokens, prec, monkeypatch):
    m = models[prec]
    full = m.target(tokens, pos(0, T), None)
    c = m.new_target_cache()
    head = m.target(tokens[:PREFIX], pos(0, PREFIX), c)  # prefill
    mid = m.target(tokens[PREFIX : PREFIX + 5], pos(PREFIX, PREFIX + 5), c)  # a verify step
    tail_logits, _ = decode_rows(m, tokens, PREFIX + 5, T, c)
    got = torch.cat([head.logits, mid.logits, tail_logits])
    print(check(got, full.logits, "reference.cache_vs_recompute", prec))
    widen_window(monkeypatch)  # broken: decode rows reach one key too far back
    bad, _ = decode_rows(m, tokens, PREFIX, T, prefill(m, tokens, PREFIX))
    with pytest.raises(AssertionError):
        check(bad, full.logits[PREFIX:], "reference.cache_vs_recompute", prec)


def draft_inputs(m, tokens):
    """Draft row at position p (1 ≤ p < T) reads token p and the target hidden of p − 1."""
    hidden = m.target(tokens, pos(0, T), None).hidden
    return tokens[1:], hidden[:-1]  # [T-1], [T-1, H], positions 1 … T-1


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_draft_cache_matches_recompute(models, tokens, prec, monkeypatch):
    m = models[prec]
    toks, hprev = draft_inputs(m, tokens)
    full = m.draft(toks, hprev, pos(1, T), None)
    c = m.new_draft_cache()
    rows = [m.draft(toks[:PREFIX], hprev[:PREFIX], pos(1, PREFIX + 1), c).logits]
    for i in range(PREFIX, T - 1):
        rows.append(m.draft(toks[i : i + 1], hprev[i : i + 1], pos(i + 1, i + 2), c).logits)
    print(check(torch.cat(rows), full.logits, "reference.cache_vs_recompute", prec))
    assert c.next_position == T
    widen_window(monkeypatch)
    c2 = m.new_draft_cache()
    m.draft(toks[:PREFIX], hprev[:PREFIX], pos(1, PREFIX + 1), c2)
    bad = [m.draft(toks[i : i + 1], hprev[i : i + 1], pos(i + 1, i + 2), c2).logits
           for i in range(PREFIX, T - 1)]
    with pytest.raises(AssertionError):
        check(torch.cat(bad), full.logits[PREFIX:], "reference.cache_vs_recompute", prec)


# --- rollback --------------------------------------------------------------------------------


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_target_rollback(models, tokens, prec, accepted):
    """Rows P … P+a−1 accepted, the next ones rejected. Decoding row by row makes the
    accepted rows' K/V bit-identical to a cache that only ever saw them."""
    m = models[prec]
    rolled = prefill(m, tokens, PREFIX)
    never = rolled.clone()
    decode_rows(m, tokens, PREFIX, PREFIX + accepted, rolled)
    decode_rows(m, tokens, PREFIX + accepted, PREFIX + 5, rolled)  # rejected
    assert rolled.next_position == PREFIX + 5
    rolled.truncate(PREFIX + accepted)
    decode_rows(m, tokens, PREFIX, PREFIX + accepted, never)
    assert caches_equal(rolled, never)
    nxt = PREFIX + accepted
    a = m.target(tokens[nxt : nxt + 1], pos(nxt, nxt + 1), rolled)
    b = m.target(tokens[nxt : nxt + 1], pos(nxt, nxt + 1), never)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_target_rollback_after_multi_row_verify(models, tokens, prec):
    m = models[prec]
    rolled = prefill(m, tokens, PREFIX)
    never = rolled.clone()
    m.target(tokens[PREFIX : PREFIX + 6], pos(PREFIX, PREFIX + 6), rolled)  # all rejected
    rolled.truncate(PREFIX)
    assert caches_equal(rolled, never)
    a = m.target(tokens[PREFIX : PREFIX + 3], pos(PREFIX, PREFIX + 3), rolled)
    b = m.target(tokens[PREFIX : PREFIX + 3], pos(PREFIX, PREFIX + 3), never)
    assert torch.equal(a.logits, b.logits)
    with pytest.raises(ValueError, match="outside"):
        rolled.truncate(PREFIX + 4)  # beyond the cached rows
    with pytest.raises(ValueError, match="outside"):
        m.new_draft_cache().truncate(0)  # before the draft's first position


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
@pytest.mark.parametrize("kept", [0, 1, 3])
def test_draft_rollback(models, tokens, prec, kept):
    """Draft depth chain from position P: depth j appends row P+j and feeds its hidden to j+1."""
    m = models[prec]
    toks, hprev = draft_inputs(m, tokens)
    rolled = m.new_draft_cache()
    m.draft(toks[: PREFIX - 1], hprev[: PREFIX - 1], pos(1, PREFIX), rolled)
    never = rolled.clone()

    def chain(cache, depths):
        h = hprev[PREFIX - 1 : PREFIX]
        for j in range(depths):
            p = PREFIX + j
            out = m.draft(toks[p - 1 : p], h, pos(p, p + 1), cache)
            h = out.hidden
        return h

    chain(rolled, 5)
    rolled.truncate(PREFIX + kept)
    h = chain(never, kept)
    assert caches_equal(rolled, never)
    p = PREFIX + kept
    a = m.draft(toks[p - 1 : p], h, pos(p, p + 1), rolled)
    b = m.draft(toks[p - 1 : p], h, pos(p, p + 1), never)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)


# --- sliding windows limit attention, full layers do not ------------------------------------


def record_attention(monkeypatch) -> list:
    outs: list[torch.Tensor] = []
    real = ops.attention

    def wrapper(*args, **kw):
        o = real(*args, **kw)
        outs.append(o)
        return o

    monkeypatch.setattr(ops, "attention", wrapper)
    return outs


def perturbed(cache: KVCache, layer: int, rows: slice, seed: int) -> KVCache:
    c = cache.clone()
    g = torch.Generator().manual_seed(seed)
    k, v = c.k[layer], c.v[layer]
    k[rows] = torch.randn(k[rows].shape, generator=g).to(k.dtype) * 3
    v[rows] = torch.randn(v[rows].shape, generator=g).to(v.dtype) * 3
    return c


def rel_change(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_sliding_layers_limit_attention(models, tokens, monkeypatch):
    """Query at t = T−1. Replace K/V of one layer at positions ≤ t−W (outside the window) or
    at t−W+1 (the oldest visible key); record every layer's attention output."""
    m = models["fp32"]
    t, w = T - 1, CFG.target.sliding_window
    base_cache = prefill(m, tokens, t)
    outs = record_attention(monkeypatch)

    def run(cache):
        outs.clear()
        m.target(tokens[t:], pos(t, T), cache)
        return list(outs)

    base = run(base_cache.clone())
    kinds = CFG.target.layer_types
    assert SLIDING in kinds[1:] and FULL in kinds[1:]
    for i, kind in enumerate(kinds):
        far = run(perturbed(base_cache, i, slice(0, t - w + 1), seed=i))  # positions 0 … t−W
        edge = run(perturbed(base_cache, i, slice(t - w + 1, t - w + 2), seed=i))
        assert all(torch.equal(far[j], base[j]) for j in range(i)), i
        if kind == SLIDING:
            assert torch.equal(far[i], base[i]), f"sliding layer {i} saw a key outside its window"
            assert rel_change(edge[i], base[i]) > 1e-3, f"layer {i} missed its oldest key"
        else:
            assert rel_change(far[i], base[i]) > 1e-2, f"full layer {i} ignored old keys"


def test_draft_window_limits_attention(models, tokens, monkeypatch):
    m = models["fp32"]
    toks, hprev = draft_inputs(m, tokens)
    t, w = T - 1, CFG.draft.sliding_window
    base_cache = m.new_draft_cache()
    m.draft(toks[: t - 1], hprev[: t - 1], pos(1, t), base_cache)  # positions 1 … t−1

    def run(cache):
        return m.draft(toks[t - 1 :], hprev[t - 1 :], pos(t, T), cache).logits

    base = run(base_cache.clone())
    # cache index = position − 1: positions 1 … t−W are indices 0 … t−W−1
    far = run(perturbed(base_cache, 0, slice(0, t - w), seed=1))
    edge = run(perturbed(base_cache, 0, slice(t - w, t - w + 1), seed=2))
    assert torch.equal(far, base)
    assert rel_change(edge, base) > 1e-3


# --- the sink is live in every layer and in the draft ----------------------------------------


def test_sink_in_every_layer_and_draft(params, tokens, monkeypatch):
    outs = record_attention(monkeypatch)
    toks = tokens[:24]
    base_m = ReferenceModel(CFG, params, "fp32")
    base = base_m.target(toks, pos(0, 24), None)
    base_attn = list(outs)
    hprev = base.hidden[:-1]
    base_draft = base_m.draft(toks[1:], hprev, pos(1, 24), None).logits
    for i in range(CFG.target.num_hidden_layers):
        p = dict(params)
        name = f"model.layers.{i}.self_attn.sink_k"
        p[name] = torch.zeros_like(params[name])
        outs.clear()
        got = ReferenceModel(CFG, p, "fp32").target(toks, pos(0, 24), None)
        assert all(torch.equal(outs[j], base_attn[j]) for j in range(i)), i
        assert rel_change(outs[i], base_attn[i]) > 1e-2, f"layer {i}: sink has no effect"
        assert rel_change(got.logits, base.logits) > 1e-3, f"layer {i}: sink has no effect"
    p = dict(params)
    p["mtp.layer.self_attn.sink_k"] = torch.zeros_like(params["mtp.layer.self_attn.sink_k"])
    got = ReferenceModel(CFG, p, "fp32").draft(toks[1:], hprev, pos(1, 24), None).logits
    assert rel_change(got, base_draft) > 1e-3, "draft: sink has no effect"
