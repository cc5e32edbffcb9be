"""Expert prefetch: the prediction twin (reference/twins/prefetch.py), traces, fit, files and the
fit CLI (training/prefetch_fit.py), and the runtime Prefetcher (iquestrt/prefetch.py): a target
forward with the prefetch kernels launched before every sliding layer's attention gives the same
bits as one without.
The kernel itself is checked against the twin in tests/kernels/test_prefetch_kernel.py.

Dimension letters: T rows, S steps, W rows per step, H hidden, E experts, K top-k, M predicted.
"""

from __future__ import annotations

import math

import pytest
import torch

import iquestrt.model
import reference.ops
from iquestrt.cache import RuntimeCaches
from iquestrt.config import RuntimeConfig
from iquestrt.model import TargetModel
from iquestrt.ops import Live, make_ops
from iquestrt.prefetch import PrefetchConfig, Prefetcher, predictor_dir
from iquestrt.weights import from_checkpoint
from reference.checkpoint import load_checkpoint, make_synthetic_checkpoint
from reference.config import preset
from reference.model import ReferenceModel
from reference.prefetch import (
    META,
    TENSORS,
    FitSpec,
    PrefetchError,
    Trace,
    collect_traces,
    coverage,
    fit_layer,
    fit_predictors,
    load_predictors,
    save_predictors,
)
from reference.synthetic import synthetic_params
from reference.twins.prefetch import (
    aggregate_ref,
    prefetch_experts_ref,
    score_partials_ref,
    scores_ref,
    select_ref,
)
from training.prefetch_fit import main, split_requests

CFG = preset("tiny")
SLIDING = CFG.target.sliding_layers


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# --- the twin ------------------------------------------------------------------------------


def test_select_order_ties_and_nan():
    agg = torch.tensor([1.0, 3.0, math.nan, 3.0, -math.inf, 0.0, -0.0, 3.0])
    key = [(-(-math.inf if math.isnan(v) else v), i) for i, v in enumerate(agg.tolist())]
    want = [i for _, i in sorted(key)]  # largest first, NaN as −inf, ties: lower index
    assert select_ref(agg, 8).tolist() == want
    assert select_ref(agg, 3).tolist() == [1, 3, 7]
    higher_first = [i for _, i in sorted((k, -i) for k, i in key)]
    assert [-i for i in higher_first] != want, "the tie order is not observable here"


def test_scores_are_the_product_on_exact_inputs():
    """Small integers: every partial sum is exact, so the pinned order must give x @ P."""
    x = torch.randint(-4, 5, (6, 300), generator=gen(1)).bfloat16()  # [T, H], J = 3 chunks
    p = torch.randint(-4, 5, (300, 10), generator=gen(2)).bfloat16()  # [H, E]
    want = (x.double() @ p.double()).float()
    assert torch.equal(scores_ref(x, p), want)
    parts = score_partials_ref(x, p)
    assert parts.shape == (3, 6, 10)
    assert not torch.equal(parts[:2].sum(0), want), "a dropped last chunk would go unseen"


def test_batched_prediction_is_the_per_step_twin():
    """coverage() predicts all steps at once; rows are independent, so each step's prediction
    is prefetch_experts_ref on that step's rows, bit for bit."""
    x = torch.randn(23, 130, generator=gen(3)).bfloat16()
    p = torch.randn(130, 12, generator=gen(4)).bfloat16()
    sc = scores_ref(x, p)
    for r in (0, 7, 22):
        assert torch.equal(sc[r], scores_ref(x[r : r + 1], p)[0])
    w, m = 5, 4
    s = x.shape[0] // w
    batched = select_ref(aggregate_ref(sc[: s * w].reshape(s, w, -1)), m)
    shifted = select_ref(aggregate_ref(sc[1 : s * w + 1].reshape(s, w, -1)), m)
    for i in range(s):
        one = prefetch_experts_ref(x[i * w : (i + 1) * w], w, p, m, 1, 8)
        assert torch.equal(batched[i].to(torch.int32), one)
    assert not torch.equal(shifted, batched), "misaligned steps would go unseen"
    assert prefetch_experts_ref(x[:6], 6, p, m, 4, 5) is None


# --- fit -----------------------------------------------------------------------------------


def planted(seed: int, t: int = 400, hidden: int = 16, experts: int = 12) -> Trace:
    """Rows c·e_h routed to a fixed pair S_h = {2h, 2h+1} mod E: a linear predictor exists."""
    h = torch.randint(0, hidden, (t,), generator=gen(seed))
    xn = (torch.nn.functional.one_hot(h, hidden) * 1.5).bfloat16()  # [T, H]
    ids = torch.stack([(2 * h) % experts, (2 * h + 1) % experts], dim=1)  # [T, K]
    return Trace([xn[: t // 2], xn[t // 2 :]], [ids[: t // 2], ids[t // 2 :]])


def test_fit_recovers_planted_routing():
    fit, held = planted(5), planted(6)
    p = fit_layer(torch.cat(fit.xn), torch.cat(fit.ids), 12, 1e-3).bfloat16()
    for w in (4, 5):
        r = coverage(p, held, w, 2 * w)  # m = the most a step can route to
        assert r["coverage"] == 1.0 and r["steps"] == 2 * (200 // w)
    # broken variant: traces misaligned by one row (ids of row t+1 fitted to xn of row t)
    p_bad = fit_layer(torch.cat([x[:-1] for x in fit.xn]),
                      torch.cat([i[1:] for i in fit.ids]), 12, 1e-3).bfloat16()
    assert coverage(p_bad, held, 4, 8)["coverage"] < 0.9


@pytest.fixture(scope="module")
def tiny_model():
    return ReferenceModel(CFG, synthetic_params(CFG, 0), "bf16-fold")


def prompts(seed: int, lengths) -> list[torch.Tensor]:
    return [torch.randint(0, CFG.target.vocab_size, (n,), generator=gen(seed + i))
            for i, n in enumerate(lengths)]


def test_traces_are_what_the_model_routed(tiny_model, monkeypatch):
    """Captured independently during a plain forward (ops.moe's ids, qkv_proj's input) vs the
    recorder's hooks; then the model is left as it was."""
    model, toks = tiny_model, prompts(10, (20, 13))
    fc_layer = {id(model.p[f"model.layers.{i}.mlp.experts.fc"]): i for i in SLIDING}
    seen_ids, seen_xn = {i: [] for i in SLIDING}, {i: [] for i in SLIDING}
    real_moe, real_lin = reference.ops.moe, model._lin

    def moe(x, w, ids, fc, proj):
        if id(fc) in fc_layer:
            seen_ids[fc_layer[id(fc)]].append(ids)
        return real_moe(x, w, ids, fc, proj)

    def lin(x, name, out_dtype=None):
        i = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if i in seen_xn and name.endswith("qkv_proj.weight"):
            seen_xn[i].append(x.clone())
        return real_lin(x, name, out_dtype)

    with monkeypatch.context() as mp:
        mp.setattr(reference.ops, "moe", moe)
        mp.setattr(model, "_lin", lin)
        before = [model.target(t, torch.arange(t.shape[0])).logits for t in toks]
    got = collect_traces(model, toks, SLIDING)
    for i in SLIDING:
        assert all(map(torch.equal, got[i].ids, seen_ids[i])), f"layer {i}: ids differ"
        assert all(map(torch.equal, got[i].xn, seen_xn[i])), f"layer {i}: xn differs"
    assert not torch.equal(got[SLIDING[0]].ids[0], seen_ids[SLIDING[1]][0]), "layers alike"
    assert "_attn" not in vars(model) and "_moe" not in vars(model)
    after = [model.target(t, torch.arange(t.shape[0])).logits for t in toks]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before, after, strict=True))


def test_fit_is_deterministic_and_round_trips(tiny_model, tmp_path):
    spec = FitSpec(fit_prompts=3, eval_prompts=2, max_tokens=24)
    fit, held = prompts(20, (24, 24, 17)), prompts(30, (24, 21))
    preds, report = fit_predictors(tiny_model, fit, held, spec)
    again, _ = fit_predictors(tiny_model, fit, held, spec)
    assert sorted(preds) == list(SLIDING)
    for i in SLIDING:
        assert preds[i].dtype == torch.bfloat16 and preds[i].shape == (128, 16)
        assert torch.equal(bits(preds[i]), bits(again[i]))
        for w in (4, 5):
            assert 0.0 <= report[i][w]["coverage"] <= 1.0
    meta = {"format": "iquestrt-prefetch-v1", "hidden": 128, "experts": 16, "m": 8,
            "layers": list(SLIDING)}
    save_predictors(tmp_path, preds, meta)
    loaded, meta2 = load_predictors(tmp_path, CFG)
    assert meta2 == meta and all(torch.equal(bits(loaded[i]), bits(preds[i])) for i in SLIDING)
    with pytest.raises(PrefetchError, match="hidden = 128, the model has 3072"):
        load_predictors(tmp_path, preset("iquest-q1"))
    save_predictors(tmp_path, {i: p.float() for i, p in preds.items()}, meta)  # writer: bf16
    assert load_predictors(tmp_path, CFG)[0][SLIDING[0]].dtype == torch.bfloat16
    save_predictors(tmp_path / "bad", {SLIDING[0]: preds[SLIDING[0]]}, meta)
    with pytest.raises(PrefetchError, match=f"layers.{SLIDING[1]}.predictor is None"):
        load_predictors(tmp_path / "bad", CFG)
    (tmp_path / META).write_text('{"format": "other"}')
    with pytest.raises(PrefetchError, match="format 'other'"):
        load_predictors(tmp_path, CFG)
    with pytest.raises(PrefetchError, match=f"{TENSORS}: no such file"):
        load_predictors(tmp_path / "nowhere", CFG)
    with pytest.raises(PrefetchError, match="FitSpec.m: expected 1..num_experts=16"):
        fit_predictors(tiny_model, fit, held, FitSpec(m=17))


def test_split_is_held_out_by_file():
    from corpus.requests import load_requests
    reqs = load_requests()
    fit, ev = split_requests(reqs, 24, 12)
    assert len(fit) == 24 and len(ev) == 12
    assert not {r["path"] for r in fit} & {r["path"] for r in ev}
    assert {r["kind"] for r in fit[:3]} == {r["kind"] for r in ev[:3]} == {
        "completion", "docstring", "edit"}
    with pytest.raises(PrefetchError, match="asked for 24 / 999"):
        split_requests(reqs, 24, 999)


def test_cli_fits_the_mini_checkpoint(tmp_path, capsys):
    main(["fit", "--checkpoint", "models/mini", "--out", str(tmp_path), "--fit-prompts", "2",
          "--eval-prompts", "1", "--max-tokens", "16"])
    out = capsys.readouterr().out
    mini = preset("mini")
    for i in mini.target.sliding_layers:
        assert f"layer {i}, 4 rows:" in out and f"layer {i}, 5 rows:" in out
    preds, meta = load_predictors(tmp_path, mini)
    assert meta["m"] == 8 and meta["min_rows"] == 4 and meta["max_rows"] == 5
    assert not set(meta["fit_requests"]) & set(meta["held_out_requests"])


# --- the runtime Prefetcher: prefetch on/off changes no bit ---------------------------------

WIDTH = 8


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefetch_ckpt")
    make_synthetic_checkpoint(d, "tiny", 0, fmt="fp8")
    return from_checkpoint(load_checkpoint(d), "cpu", 256)


def router_predictors(w) -> dict[int, torch.Tensor]:
    """The layer's own router on its incoming hidden: a fair stand-in for a fitted predictor."""
    return {i: w.layers[i].moe.router.T.contiguous().bfloat16() for i in SLIDING}


class WritesRouterInput(Prefetcher):
    """Broken variant: stores its ids into xn, the residual base the router input comes from."""

    def maybe_prefetch(self, layer_index, xn, live):
        h = super().maybe_prefetch(layer_index, xn, live)
        if h is not None:
            xn[0, : self.m] = h.ids.to(xn.dtype)
        return h


def run_steps(w, pf, monkeypatch):
    """A 6-row prefill (no prefetch: 6 rows), then a 4-row step at position 6 → logits, hidden,
    caches and the launches [(layer, xn, ids)]."""
    rcfg = RuntimeConfig(ops="twins", device="cpu", ring_pad=8, max_positions=256)
    model = TargetModel(w, make_ops("twins", "cpu", rcfg.max_polls), WIDTH)
    caches = RuntimeCaches.create(w.cfg, rcfg, 32, torch.device("cpu"))
    flags = torch.zeros(w.cfg.target.num_hidden_layers, dtype=torch.int32)
    layer_of = {id(layer.attn): layer.index for layer in w.layers}
    launches, real = [], iquestrt.model.attention_block

    def attention_block(ops, cfg_t, aw, xn, pos, live, cache, table, **kw):
        if pf is not None:
            h = pf.maybe_prefetch(layer_of[id(aw)], xn, live)
            if h is not None:
                launches.append((layer_of[id(aw)], xn.clone(), h.ids.clone()))
        return real(ops, cfg_t, aw, xn, pos, live, cache, table, **kw)

    toks = torch.randint(0, CFG.target.vocab_size, (10,), generator=gen(77))
    with monkeypatch.context() as mp:
        mp.setattr(iquestrt.model, "attention_block", attention_block)
        model.forward(toks[:6], 0, caches, flags)
        n_prefill = len(launches)
        logits, hidden = model.forward(toks[6:], 6, caches, flags)
    assert n_prefill == 0, "6 live rows must not prefetch"
    return logits, hidden, caches, launches


def same_bits(a, b) -> bool:
    la, ha, ca, _ = a
    lb, hb, cb, _ = b
    return (torch.equal(bits(la), bits(lb)) and torch.equal(bits(ha), bits(hb))
            and all(torch.equal(bits(x.k), bits(y.k)) and torch.equal(bits(x.v), bits(y.v))
                    for x, y in zip(ca.target, cb.target, strict=True)))


@pytest.mark.slow
def test_prefetch_on_off_same_bits(weights, monkeypatch):
    preds = router_predictors(weights)
    on = Prefetcher(weights, preds, 8, PrefetchConfig(), WIDTH, launch=True)
    off = Prefetcher(weights, preds, 8, PrefetchConfig(enabled=False), WIDTH, launch=True)
    r_on, r_off = run_steps(weights, on, monkeypatch), run_steps(weights, off, monkeypatch)
    r_none = run_steps(weights, None, monkeypatch)
    assert [layer for layer, _, _ in r_on[3]] == list(SLIDING) and not r_off[3]
    for layer, xn, ids in r_on[3]:  # the kernels ran, on the layer's real input
        assert torch.equal(ids, prefetch_experts_ref(xn, 4, preds[layer], 8, 4, 5))
    assert same_bits(r_on, r_off) and same_bits(r_on, r_none)
    broken = WritesRouterInput(weights, preds, 8, PrefetchConfig(), WIDTH, launch=True)
    assert not same_bits(run_steps(weights, broken, monkeypatch), r_off), "check is blind"


def test_device_live_count_gates_in_the_kernel(weights):
    preds = router_predictors(weights)
    pf = Prefetcher(weights, preds, 8, PrefetchConfig(), WIDTH, launch=True)
    layer = SLIDING[0]
    xn = torch.randn(WIDTH, 128, generator=gen(5)).bfloat16()
    buf = pf.buffers[layer]
    buf.ids.fill_(-7)
    assert pf.maybe_prefetch(layer, xn, Live.on_device(torch.tensor([6], dtype=torch.int32)))
    assert (buf.ids == -7).all(), "6 device-side rows wrote ids"
    pf.maybe_prefetch(layer, xn, Live.on_device(torch.tensor([5], dtype=torch.int32)))
    assert torch.equal(buf.ids, prefetch_experts_ref(xn, 5, preds[layer], 8, 4, 5))
    assert pf.maybe_prefetch(0, xn, Live.of(4, "cpu")) is None  # no predictor: full layer
    twins = Prefetcher(weights, preds, 8, PrefetchConfig(), WIDTH, launch=False)
    assert twins.maybe_prefetch(layer, xn, Live.of(4, "cpu")) is None and not twins.buffers


def test_prefetcher_rejects_bad_setup(weights, tmp_path):
    preds = router_predictors(weights)
    with pytest.raises(ValueError, match="layer 0 has no MoE"):
        Prefetcher(weights, {0: preds[SLIDING[0]]}, 8, PrefetchConfig(), WIDTH, True)
    with pytest.raises(ValueError, match="predictor has shape"):
        Prefetcher(weights, {SLIDING[0]: preds[SLIDING[0]].T}, 8, PrefetchConfig(), WIDTH, True)
    with pytest.raises(ValueError, match=r"m = 17 outside \[1, 16\]"):
        Prefetcher(weights, preds, 17, PrefetchConfig(), WIDTH, True)
    with pytest.raises(ValueError, match="min_rows <= max_rows"):
        PrefetchConfig(min_rows=5, max_rows=4)
    meta = {"format": "iquestrt-prefetch-v1", "hidden": 128, "experts": 16, "m": 6,
            "layers": list(SLIDING)}
    save_predictors(predictor_dir(tmp_path), preds, meta)
    pf = Prefetcher.load(tmp_path, weights, PrefetchConfig(), WIDTH, "kernels")
    assert pf.m == 6 and pf.launch and sorted(pf.p) == list(SLIDING)
    assert not Prefetcher.load(tmp_path, weights, PrefetchConfig(m=3), WIDTH, "twins").launch
