"""Draft-depth policies (reference/depth.py) and their offline fit (training/depth_fit.py).

Synthetic rounds for the fit have known answers: with acceptance independent of the features
the best rule is the best fixed depth, found here from the closed form E[min(A, d) + 1] =
Σ_{i≤d} α^i; with two round types revealed by the features it is the best pair of per-type
depths, found by enumeration. A Markov toy model (logits depend only on the row's token) drives
the reference generator where real rounds are needed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.config import DraftConfig, SamplingDefaults
from reference.depth import (
    AdaptiveDepth,
    DraftInfo,
    FixedDepth,
    default_adaptive,
    host_features,
    init_features,
    legal_param,
    load_policy,
    policy_from_spec,
    push_features,
    save_policy,
)
from reference.model import KVCache, Output
from reference.speculative import GenerationRequest, ReferenceGenerator, RoundRecord
from training.depth_fit import (
    CostModel,
    Records,
    depths_run,
    evaluate,
    fit,
    fixed_as_adaptive,
    records_from_rounds,
)


def _random_policy(g: torch.Generator, lo: int = 3, hi: int = 7, theta: float = 0.3):
    w = torch.randn(hi - lo, 6, generator=g, dtype=torch.float64) * 0.5
    return AdaptiveDepth(tuple(tuple(legal_param(float(x)) for x in r) for r in w), theta, lo, hi)


def _random_drafts(g: torch.Generator, n: int, d: int = 7):
    u = torch.rand(n, d, generator=g, dtype=torch.float64) ** 2
    q = torch.where(torch.arange(n)[:, None] % 2 == 0, u, 1 - 0.5 * u)  # small and large cum
    h = torch.rand(n, d, generator=g, dtype=torch.float64) * 5
    return (
        q,
        h,
        [[DraftInfo(0, float(q[i, j]), float(h[i, j])) for j in range(d)] for i in range(n)],
    )


def _device_features(q: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
    f, out = init_features(q.shape[0]), []
    for j in range(q.shape[1]):
        f = push_features(f, q[:, j], h[:, j])
        out.append(f)
    return out  # [j-1]: after j drafts


# --- depth bounds and the draft loop -----------------------------------------------------

_FLOATS = st.one_of(
    st.floats(0.0, 1.0),
    st.sampled_from([0.0, 1.0, 1e-45, 2.0**-40, 2.0**-41, math.nan, math.inf, -1.0, 3.0]),
)
_ENTROPY = st.one_of(st.floats(0.0, 20.0), st.sampled_from([0.0, 1e-30, math.nan, math.inf, 100.0]))
_WEIGHT = st.one_of(
    st.floats(-50.0, 50.0), st.sampled_from([0.0, 2.0**-20, -(2.0**20), 1e-30, 1e9])
)


@settings(max_examples=150, deadline=None)
@given(
    lo=st.integers(3, 7),
    span=st.integers(0, 4),
    weights=st.lists(st.lists(_WEIGHT, min_size=6, max_size=6), min_size=4, max_size=4),
    theta=st.floats(-5.0, 5.0),
    probs=st.lists(_FLOATS, min_size=9, max_size=9),
    ents=st.lists(_ENTROPY, min_size=9, max_size=9),
)
def test_adaptive_runs_between_3_and_7_depths(lo, span, weights, theta, probs, ents):
    hi = min(lo + span, 7)
    rows = tuple(tuple(legal_param(x) for x in r) for r in weights[: hi - lo])
    p = AdaptiveDepth(rows, legal_param(theta), lo, hi)
    seq = [DraftInfo(j, q, h) for j, (q, h) in enumerate(zip(probs, ents, strict=True))]
    drafts: list[DraftInfo] = []
    while p.more(drafts):  # the generator's loop without its max_depth guard
        drafts.append(seq[len(drafts)])
        assert len(drafts) <= 7
    assert 3 <= lo <= len(drafts) <= hi <= 7
    # the device form stops at the same depth
    q = torch.tensor([probs], dtype=torch.float64)
    h = torch.tensor([ents], dtype=torch.float64)
    feats, alive, depth = _device_features(q, h), torch.tensor([True]), 0
    alive = alive & p.more_batch(0, init_features(1))
    for j in range(1, 9):
        depth += int(alive)
        alive = alive & p.more_batch(j, feats[j - 1])
    assert depth == len(drafts)


def test_fixed_depth_unchanged():
    p = FixedDepth(4)
    assert p.max_depth == 4 and p.more([DraftInfo(0, 0.1, 1.0)] * 3)
    assert not p.more([DraftInfo(0, 0.9, 0.1)] * 4)


# --- host vs device: the same fp32 decision, bit for bit ---------------------------------


def test_host_and_tensor_forms_decide_identically():
    g = torch.Generator().manual_seed(11)
    q, h, rows = _random_drafts(g, 3000)
    feats = _device_features(q, h)
    for theta in (0.0, 0.1, 0.3, 0.7):
        p = _random_policy(g, theta=theta)
        table = p.table()
        for n in range(0, 8):
            f = init_features(len(rows)) if n == 0 else feats[n - 1]
            dev = p.more_batch(torch.full((len(rows),), n), f, table)
            host = torch.tensor([p.more(r[:n]) for r in rows])
            assert torch.equal(dev, host), (theta, n)
        # the features themselves agree bit for bit
        for n in (1, 4, 7):
            host_f = torch.tensor([host_features(r[:n]) for r in rows], dtype=torch.float64)
            assert torch.equal(feats[n - 1].double(), host_f)


def _numpy_score(p: AdaptiveDepth, n: int, cum: float, q: float, h: float) -> np.float32:
    b, w1, w2, w3, w4, w5 = (np.float32(x) for x in p.weights[n - p.min_depth])
    cum, q, h = np.float32(cum), np.float32(q), np.float32(h)
    s = b + w1 * cum
    s = s + w2 * q
    s = s + w3 * h
    s = s + w4 * (cum * q)
    return s + w5 * (cum * h)


def test_decisions_at_the_threshold_boundary():
    """θ set to a row's own fp32 score must continue, θ one ulp above must stop, in both forms;
    a float64 evaluation of the same formula (the broken variant) gets some of these wrong."""
    g = torch.Generator().manual_seed(5)
    q, h, rows = _random_drafts(g, 300)
    feats = _device_features(q, h)
    p0, broken_wrong, checked = _random_policy(g), 0, 0
    for i, r in enumerate(rows):
        n = 3 + i % 4
        cum, qq, hh = host_features(r[:n])
        s = p0.score(n, cum, qq, hh)
        assert np.float32(s) == _numpy_score(p0, n, cum, qq, hh)  # IEEE fp32, this op order
        if s == 0 or not 2.0**-20 <= abs(s) <= 2.0**20:
            continue
        checked += 1
        f = feats[n - 1][i : i + 1]
        up = float(np.nextafter(np.float32(s), np.float32(np.inf)))
        for theta, want in ((s, True), (up, False)):
            p = replace(p0, threshold=theta)
            assert p.more(r[:n]) is want
            assert bool(p.more_batch(n, f)) is want
        b, w1, w2, w3, w4, w5 = p0.weights[n - 3]
        s64 = b + w1 * cum + w2 * qq + w3 * hh + w4 * cum * qq + w5 * cum * hh  # one rounding
        up = float(np.nextafter(np.float32(s), np.float32(np.inf)))
        broken_wrong += (s64 >= s) is not True or (s64 >= up) is not False
    assert checked >= 250
    assert broken_wrong > 0, "a float64 score must disagree with the fp32 rule somewhere"


# --- never discarding drafts: the reference generator with an adaptive policy -------------

V = 16


@dataclass(frozen=True)
class _T:
    vocab_size: int = V
    max_position_embeddings: int = 4096


@dataclass(frozen=True)
class _Cfg:
    target: _T = _T()
    # the toy caches' expectations are written for "keep" (tests/reference/test_draft_conventions.py
    # covers "recompute")
    draft: DraftConfig = DraftConfig(draft_position_offset=0, draft_kv_settle="keep")


class _Toy:
    """Logits depend only on the row's token (target table a, draft table b); records every
    verification row block and counts draft depths."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.cfg, self.a, self.b = _Cfg(), a, b
        self.verified: list[list[int]] = []
        self.draft_calls = 0

    def _rows(self, table, tokens, cache):
        kv = tokens.float()[:, None, None]  # [R, 1, 1]
        cache.append(0, kv, kv)
        return Output(table[tokens].clone(), torch.nn.functional.one_hot(tokens, V).float())

    def target(self, tokens, positions, cache=None):
        self.verified.append(tokens.tolist())
        return self._rows(self.a, tokens, cache)

    def draft(self, tokens, hprev, positions, cache=None):
        self.draft_calls += 1
        return self._rows(self.b, tokens, cache)

    def new_target_cache(self):
        return KVCache(1, start=0)

    def new_draft_cache(self):
        return KVCache(1, start=1)


def _toy(seed: int, noise: float) -> _Toy:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(V, V, generator=g) * 3
    return _Toy(a, a + torch.randn(V, V, generator=g) * noise)


def test_generator_verifies_every_draft_the_policy_ran():
    toy = _toy(2, 0.7)
    policy = AdaptiveDepth(((0.0, 0.0, 1.0, 0.0, 0.0, 0.0),) * 4, 0.3)  # continue while q ≥ 0.3
    calls: list[int] = []
    req = GenerationRequest((1, 2, 3), 150, SamplingDefaults(1.0, 0, 1.0), seed=4)

    def on_round(rec: RoundRecord) -> None:
        calls.append(toy.draft_calls)

    res = ReferenceGenerator(toy, policy).generate(req, on_round)
    depths = [len(r.drafts) for r in res.rounds]
    assert set(depths) == {3, 4, 5, 6, 7}, depths
    runs = [b - a for a, b in zip([0] + calls, calls, strict=False)]
    verify = toy.verified[1:]  # [0] is the prompt's prefill
    for r, ran, rows in zip(res.rounds, runs, verify, strict=True):
        assert ran == len(r.drafts)  # one draft forward per depth run …
        assert rows[1:] == [d.token for d in r.drafts]  # … and every draft goes to the target
        assert r.drafts[-1].prob < 0.3 or len(r.drafts) == 7  # it stopped for its own reason
        assert all(d.prob >= 0.3 for d in r.drafts[2:-1])  # … after continuing for its own


def test_shallower_depth_accepts_the_prefix_of_a_deeper_one():
    """The replay premise of depth_fit: the first round drafted to d accepts min(a_7, d)."""
    seen_full = 0
    for seed in range(12):
        toy = _toy(seed, 0.3)
        req = GenerationRequest((seed % V, 5), 2, SamplingDefaults(1.0, 0, 1.0), seed=seed)
        deep = ReferenceGenerator(toy, FixedDepth(7)).generate(req).rounds[0]
        for d in range(3, 7):
            r = ReferenceGenerator(_toy(seed, 0.3), FixedDepth(d)).generate(req).rounds[0]
            assert r.drafts == deep.drafts[:d]
            assert r.accepted == min(deep.accepted, d)
            seen_full += deep.accepted >= d
    assert seen_full > 5, "the cases must include rounds where the shallow depth accepts all"


# --- the offline fit on rounds with known optimal answers --------------------------------


def _leading_accepts(p_acc: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """a = drafts accepted before the first rejection; draft j accepted w.p. p_acc[:, j]."""
    ok = torch.rand(p_acc.shape, generator=g, dtype=torch.float64) < p_acc  # [N, 7]
    return ok.long().cumprod(1).sum(1)


def _iid_records(n: int, seed: int, alpha: float) -> Records:
    g = torch.Generator().manual_seed(seed)
    a = _leading_accepts(torch.full((n, 7), alpha, dtype=torch.float64), g)
    return Records(torch.full((n, 7), 0.5), torch.full((n, 7), 1.0), a)


def _two_type_records(n: int, seed: int, alpha_easy: float, alpha_hard: float):
    """Half the rounds 'easy' (q = 0.85, h = 0.5), half 'hard' (q = 0.3, h = 2.5)."""
    g = torch.Generator().manual_seed(seed)
    easy = torch.rand(n, generator=g) < 0.5  # [N]
    alpha = torch.where(easy, alpha_easy, alpha_hard).double()[:, None].expand(n, 7)
    q = torch.where(easy, 0.85, 0.3)[:, None].expand(n, 7).contiguous()
    h = torch.where(easy, 0.5, 2.5)[:, None].expand(n, 7).contiguous()
    return Records(q, h, _leading_accepts(alpha, g)), easy


def _served(alpha: float, d: int) -> float:
    """E[min(A, d) + 1] for P(A ≥ i) = α^i, i ≤ 7."""
    return sum(alpha**i for i in range(d + 1))


def test_uninformative_features_collapse_to_the_best_fixed_depth():
    alpha, cost = 0.6, CostModel(depth=0.0525, round=1.0)
    rate = {d: _served(alpha, d) / (1 + d * cost.depth) for d in range(3, 8)}
    best = max(rate, key=rate.get)
    assert best == 4  # the case is built to have an interior optimum
    train = _iid_records(20000, 0, alpha)
    report = fit(train, cost)
    assert report.best_fixed == best
    # each depth's score estimates the chance that the next depth adds a token, P(A ≥ j+1):
    # nearer that frequency than its neighbours' (an off-by-one regression target is not)
    for j in range(3, 7):
        s = report.policy.score(j, 0.5**j, 0.5, 1.0)
        freq = [float((train.accepted >= i).double().mean()) for i in (j, j + 1, j + 2)]
        assert min(range(3), key=lambda i: abs(freq[i] - s)) == 1, (j, s, freq)
    held_out = _iid_records(20000, 1, alpha)
    assert depths_run(report.policy, held_out).unique().tolist() == [best]
    # broken variant: break even at θ = cost of a depth (λ forgotten) runs deeper and loses
    broken = replace(report.policy, threshold=cost.marginal)
    assert depths_run(broken, held_out).unique().tolist() != [best]
    assert (
        evaluate(broken, held_out, cost).throughput
        < evaluate(report.policy, held_out, cost).throughput
    )


def test_informative_features_reach_the_per_type_optimum_and_beat_every_fixed_depth():
    ae, ah, cost = 0.75, 0.5, CostModel(depth=0.08, round=1.0)
    pairs = {
        (de, dh): (_served(ae, de) + _served(ah, dh)) / (2 + (de + dh) * cost.depth)
        for de in range(3, 8)
        for dh in range(3, 8)
    }
    de, dh = max(pairs, key=pairs.get)
    fixed = {d: pairs[(d, d)] for d in range(3, 8)}
    assert (de, dh) == (6, 3) and max(fixed, key=fixed.get) == 4  # interior, and they differ
    train, _ = _two_type_records(20000, 0, ae, ah)
    report = fit(train, cost)
    test, easy = _two_type_records(20000, 1, ae, ah)
    d = depths_run(report.policy, test)
    assert d[easy].unique().tolist() == [de] and d[~easy].unique().tolist() == [dh]
    adaptive = evaluate(report.policy, test, cost).throughput
    fixed_meas = {k: evaluate(FixedDepth(k), test, cost).throughput for k in range(3, 8)}
    assert adaptive > max(fixed_meas.values())
    # broken variant: outcomes paired with the previous round's features (an off-by-one in
    # the recording) carry no signal; the rule falls back to a fixed depth and loses
    shifted = Records(train.probs, train.entropies, torch.roll(train.accepted, 1))
    broken = evaluate(fit(shifted, cost).policy, test, cost).throughput
    assert broken <= max(fixed_meas.values()) < adaptive


def test_fit_from_round_records_and_its_errors():
    g = torch.Generator().manual_seed(3)
    q, h, rows = _random_drafts(g, 400)
    acc = _leading_accepts(q, g)
    rounds = [RoundRecord(0, r, int(a), [], False) for r, a in zip(rows, acc, strict=True)]
    rec = records_from_rounds(rounds)
    assert torch.equal(rec.probs, q.float()) and torch.equal(rec.accepted, acc)
    report = fit(rounds, CostModel(0.05, 1.0, row=0.01))
    assert set(report.fixed) == {3, 4, 5, 6, 7}
    assert report.adaptive.throughput >= max(v.throughput for v in report.fixed.values())
    summary = json.loads(json.dumps(report.summary()))
    assert summary["best_fixed"] == report.best_fixed and "gain vs best fixed" in report.table()
    short = rounds[:5] + [RoundRecord(0, rows[5][:6], 2, [], False)]
    with pytest.raises(ValueError, match=r"round 5: 6 drafts, need ≥ 7"):
        records_from_rounds(short)
    with pytest.raises(ValueError, match=r"round 0: accepted=9"):
        records_from_rounds([RoundRecord(0, rows[0], 9, [], False)])
    with pytest.raises(ValueError, match=r"CostModel.round"):
        CostModel(0.05, 0.0)
    with pytest.raises(ValueError, match=r"CostModel.depth"):
        CostModel(math.nan, 1.0)
    with pytest.raises(ValueError, match=r"max_depth 7 exceeds the records' depth 5"):
        depths_run(
            default_adaptive(),
            Records(rec.probs[:, :5], rec.entropies[:, :5], rec.accepted.clamp(max=5)),
        )


# --- validation and storage ---------------------------------------------------------------

_ROW = (0.0, 0.0, 1.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(min_depth=2, weights=(_ROW,) * 5), r"min_depth must be in \[3, 7\], got 2"),
        (dict(max_depth=8, weights=(_ROW,) * 5), r"max_depth must be in \[min_depth=3, 7\]"),
        (dict(min_depth=5, max_depth=4, weights=()), r"max_depth must be in \[min_depth=5"),
        (dict(weights=(_ROW,) * 3), r"one row per decision depth 3 … 6 \(4 rows\), got 3"),
        (dict(weights=(_ROW,) * 3 + ((1.0,) * 5,)), r"weights\[depth 6\] needs 6 values"),
        (dict(weights=(_ROW,) * 3 + ((math.nan,) * 6,)), r"weights\[depth 6\]\[0\]: must be 0"),
        (dict(weights=((0.0, 1e-9) + _ROW[2:],) + (_ROW,) * 3), r"weights\[depth 3\]\[1\]"),
        (dict(threshold=2.0**21), r"threshold: must be 0 or of magnitude"),
        (dict(threshold="0.3"), r"threshold: must be a number, got '0.3'"),
        (dict(min_depth=True), r"min_depth must be an int"),
    ],
)
def test_adaptive_rejects_bad_parameters(kw, message):
    args = dict(weights=(_ROW,) * 4, threshold=0.3) | kw
    with pytest.raises(ValueError, match=message):
        AdaptiveDepth(**args)


def test_policy_json_round_trip(tmp_path):
    g = torch.Generator().manual_seed(9)
    for p in (_random_policy(g), _random_policy(g, 4, 6, 0.05), FixedDepth(0), FixedDepth(7)):
        save_policy(tmp_path, p, fit={"note": "test"})
        back = load_policy(tmp_path)
        assert back == p and type(back) is type(p)
    assert load_policy(tmp_path / "missing") == FixedDepth(5)  # documented default
    save_policy(tmp_path, adaptive := _random_policy(g))
    assert policy_from_spec("adaptive", tmp_path) == adaptive
    assert policy_from_spec(" Adaptive ") == default_adaptive()
    assert policy_from_spec("0") == FixedDepth(0) and policy_from_spec("7") == FixedDepth(7)
    for bad in ("8", "-1", "three", "", "3.0"):
        with pytest.raises(ValueError, match=r"expected 'adaptive' or a fixed depth 0 … 7"):
            policy_from_spec(bad)


def _good() -> dict:
    return {
        "format": "iquestrt.depth_policy",
        "version": 1,
        "kind": "adaptive",
        "min_depth": 3,
        "max_depth": 7,
        "threshold": 0.125,
        "weights": {str(j): list(_ROW) for j in range(3, 7)},
    }


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format="other"), r"field 'format' must be 'iquestrt.depth_policy'"),
        (lambda d: d.update(version=2), r"field 'version' must be 1"),
        (lambda d: d.update(kind="learned"), r"field 'kind' must be 'fixed' or 'adaptive'"),
        (lambda d: d.update(extra=1), r"unknown fields \['extra'\]"),
        (lambda d: d.pop("threshold"), r"threshold: must be a number, got None"),
        (lambda d: d.update(threshold=math.nan), r"threshold: must be 0 or of magnitude"),
        (lambda d: d.update(min_depth=2), r"'min_depth' ≤ 'max_depth' must lie in \[3, 7\]"),
        (lambda d: d.update(max_depth=8), r"'min_depth' ≤ 'max_depth' must lie in \[3, 7\]"),
        (lambda d: d.update(min_depth="3"), r"field 'min_depth' must be an integer"),
        (lambda d: d["weights"].pop("5"), r"field 'weights' needs exactly the keys"),
        (lambda d: d["weights"].update({"4": 1.0}), r"field 'weights.4' must be a list"),
        (lambda d: d["weights"]["6"].__setitem__(2, "x"), r"weights\[depth 6\]\[2\]: must be a"),
        (lambda d: d.update(fit=[1]), r"field 'fit' must be an object"),
        (lambda d: d.update(kind="fixed"), r"unknown fields"),
        (
            lambda d: (
                d.clear()
                or d.update(format="iquestrt.depth_policy", version=1, kind="fixed", depth=9)
            ),
            r"'depth' must be in \[0, 7\]",
        ),
    ],
)
def test_bad_policy_files_name_file_and_field(tmp_path, edit, message):
    d = _good()
    edit(d)
    path = tmp_path / "depth_policy.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=message) as e:
        load_policy(tmp_path)
    assert str(path) in str(e.value)


def test_unreadable_policy_file(tmp_path):
    (tmp_path / "depth_policy.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"depth_policy.json: not valid JSON"):
        load_policy(tmp_path)
    (tmp_path / "depth_policy.json").write_text("[]")
    with pytest.raises(ValueError, match=r"top level must be a JSON object, got list"):
        load_policy(tmp_path)


def test_fit_never_loses_to_the_best_fixed_depth_on_its_records(monkeypatch):
    """A regression that anti-predicts (its weights negated): the threshold search cannot
    rescue it, so the fit must fall back to the best fixed depth."""
    import training.depth_fit as depth_fit

    train, _ = _two_type_records(8000, 2, 0.75, 0.5)
    cost = CostModel(0.08, 1.0)
    good = depth_fit._regression
    monkeypatch.setattr(
        depth_fit,
        "_regression",
        lambda *a: tuple((b,) + tuple(legal_param(-x) for x in w) for b, *w in good(*a)),
    )
    report = fit(train, cost)
    k = report.best_fixed
    assert report.policy == fixed_as_adaptive(k)
    assert depths_run(report.policy, train).unique().tolist() == [k]
    assert evaluate(report.policy, train, cost) == report.fixed[k]
    monkeypatch.setattr(depth_fit, "_regression", good)
    assert fit(train, cost).adaptive.throughput > report.fixed[k].throughput
