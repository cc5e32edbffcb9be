"""The synthetic tiny model is healthy in FP32 and BF16, layer by layer.

Every layer is instrumented by wrapping ops.rms_norm / ops.attention / ops.route during one
pass (norm inputs are named through the identity of their weight tensor). Attention weights are
recomputed from the recorded q/k with the float64 oracle, so the statistics do not trust the
code under test.
"""

import math

import pytest
import torch

from reference import ops
from reference.config import preset
from reference.model import ReferenceModel
from reference.synthetic import synthetic_params
from tests.helpers import oracles as O

CFG = preset("tiny")
T = 64


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with O.torch_threads(1):
        yield


@pytest.fixture(scope="module")
def params():
    return synthetic_params(CFG, 0)


def make_trace(params, prec: str) -> dict:
    """One no-cache target pass over T tokens and one draft pass, with every layer recorded."""
    m = ReferenceModel(CFG, params, prec)
    names = {id(t): n for n, t in m.p.items()}
    rec = {"norm": {}, "attn": [], "route": []}
    real_norm, real_attn, real_route = ops.rms_norm, ops.attention, ops.route

    def norm(x, w, *a, **kw):
        rec["norm"][names[id(w)]] = x
        return real_norm(x, w, *a, **kw)

    def attn(*a, **kw):
        rec["attn"].append(a)
        return real_attn(*a, **kw)

    def route(*a, **kw):
        out = real_route(*a, **kw)
        rec["route"].append(out)
        return out

    toks = torch.randint(0, CFG.target.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    with pytest.MonkeyPatch.context() as mp:
        for name, fn in (("rms_norm", norm), ("attention", attn), ("route", route)):
            mp.setattr(ops, name, fn)
        out = m.target(toks, torch.arange(T), None)
        d = m.draft(toks[1:], out.hidden[:-1], torch.arange(1, T), None)
    rec["logits"] = {"target": out.logits, "draft": d.logits}
    return rec


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def trace(request, params):
    return make_trace(params, request.param)


def rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


def test_residual_stream_finite_and_bounded(trace):
    layers = CFG.target.num_hidden_layers
    wanted = [f"model.layers.{i}.{n}.weight" for i in range(layers)
              for n in ("attention_norm", "feed_forward_norm")]
    wanted += ["model.norm.weight", "mtp.layer.attention_norm.weight",
               "mtp.layer.feed_forward_norm.weight", "mtp.norm.weight"]
    for name in wanted:
        x = trace["norm"][name]
        assert torch.isfinite(x).all(), name
        assert 0.5 < rms(x) < 4.0, f"{name}: residual rms {rms(x):.3f}"


def attention_stats(args):
    """(normalized entropy over real keys of rows with ≥ 8 visible keys [n], sink mass [R, Hq])."""
    q, k, _v, q_pos, k_pos, window, sink, scale = args[:8]
    probs = O.attention_probs64(q, k, q_pos.tolist(), k_pos.tolist(), window, sink, scale)
    sink_mass = probs[..., -1]
    real = probs[..., :-1] / (1 - sink_mass[..., None])
    n_vis = (probs[..., :-1] > 0).sum(-1)  # [R, Hq]
    ent = -(real * real.clamp_min(1e-300).log()).sum(-1)
    sel = n_vis >= 8
    return (ent[sel] / n_vis[sel].double().log()), sink_mass


def test_attention_neither_collapsed_nor_uniform(trace):
    assert len(trace["attn"]) == CFG.target.num_hidden_layers + 1  # + the draft layer
    for i, args in enumerate(trace["attn"]):
        nent, _ = attention_stats(args)
        assert nent.numel() > 100, i
        assert 0.35 < nent.mean() < 0.9, f"attention call {i}: normalized entropy {nent.mean():.3f}"


def test_sink_mass_comparable(trace):
    """s comparable to L: the sink takes a real share on average and is live for many rows."""
    for i, args in enumerate(trace["attn"]):
        _, mass = attention_stats(args)
        assert args[6] is not None, f"attention call {i} has no sink"
        assert 0.02 < mass.mean() < 0.98, f"attention call {i}: sink mass {mass.mean():.3f}"
        live = ((mass > 0.02) & (mass < 0.98)).double().mean()
        assert live > 0.25, f"attention call {i}: sink live in only {live:.1%} of (row, head)"


def test_routing_not_collapsed(trace):
    e, k = CFG.target.num_experts, CFG.target.num_experts_per_tok
    assert len(trace["route"]) == CFG.target.num_hidden_layers - 1 + 1  # MoE layers + draft
    for i, (w, ids) in enumerate(trace["route"]):
        count = torch.bincount(ids.flatten(), minlength=e)
        assert (count > 0).sum() >= 10, f"route {i}: only {(count > 0).sum()} experts of {e} used"
        share = (count.max() / count.sum()).item()
        assert share < 0.3, f"route {i}: one expert takes {share:.1%} of {T}x{k} assignments"
        assert 1 / k < w[:, 0].mean() < 0.9, f"route {i}: top-1 weight {w[:, 0].mean():.3f}"


@pytest.mark.parametrize("which", ["target", "draft"])
def test_logits_neither_flat_nor_one_hot(trace, which):
    logits = trace["logits"][which].double()
    assert torch.isfinite(logits).all()
    p = torch.softmax(logits, -1)
    top = p.max(-1).values
    ent = -(p * p.log()).sum(-1)
    assert logits.std(-1).min() > 1.0, "flat logits"
    assert 0.05 < top.mean() < 0.8 and top.max() < 0.999, f"top-1 probability {top.mean():.3f}"
    assert 0.5 < ent.mean() < math.log(logits.shape[-1]) - 0.5, f"entropy {ent.mean():.2f}"


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.slow
def test_generate_200_tokens_with_cache(params, prec, sample):
    """Greedy / temperature-1 sampling (torch.multinomial, seeded) for 200 tokens, the draft
    running one depth beside the target on its own cache. Nothing may become non-finite."""
    m = ReferenceModel(CFG, params, prec)
    g = torch.Generator().manual_seed(7)
    toks = torch.randint(0, CFG.target.vocab_size, (8,), generator=g)
    tc, dc = m.new_target_cache(), m.new_draft_cache()
    out = m.target(toks, torch.arange(8), tc)
    m.draft(toks[1:], out.hidden[:-1], torch.arange(1, 8), dc)
    hidden, logits = out.hidden[-1:], out.logits[-1]
    seq, ent = toks.tolist(), []
    for n in range(8, 208):
        assert torch.isfinite(logits).all(), f"target logits at position {n - 1}"
        p = torch.softmax(logits.double(), -1)
        ent.append(-(p * p.log()).sum().item())
        nxt = (torch.multinomial(torch.softmax(logits, -1), 1, generator=g) if sample
               else logits.argmax(-1, keepdim=True))
        seq.append(int(nxt))
        d = m.draft(nxt, hidden, torch.tensor([n]), dc)
        assert torch.isfinite(d.logits).all() and torch.isfinite(d.hidden).all(), n
        out = m.target(nxt, torch.tensor([n]), tc)
        hidden, logits = out.hidden, out.logits[-1]
    assert tc.next_position == dc.next_position == 208
    # Random-weight models fall into repetition loops (seen: period-2 greedy cycles), but the
    # next-token distribution must stay broad: mean entropy of the last 50 steps ≥ 1 nat
    # (measured 1.8–3.0 over 2 seeds x 2 modes x greedy/sampled).
    assert sum(ent[-50:]) / 50 > 1.0, f"entropy collapsed to {sum(ent[-50:]) / 50:.2f} nats"
    if sample:
        assert len(set(seq[8:])) > 20, f"only {len(set(seq[8:]))} distinct sampled tokens"


def scaled(params, suffixes: tuple[str, ...], gain: float) -> dict:
    return {n: t * gain if n.endswith(suffixes) else t for n, t in params.items()}


@pytest.mark.parametrize(
    "suffixes,gain,check",
    [
        (("q_norm.weight", "k_norm.weight"), 1 / 1.5, test_attention_neither_collapsed_nor_uniform),
        (("sink_k",), 10.0, test_sink_mass_comparable),
        (("router.weight",), 20.0, test_routing_not_collapsed),
        (("lm_head.weight",), 10.0, lambda tr: test_logits_neither_flat_nor_one_hot(tr, "target")),
    ],
    ids=["qk-gain-1", "sink-x10", "router-x20", "lm-head-x10"],
)
def test_health_checks_catch_broken_scales(params, suffixes, gain, check):
    check(make_trace(params, "fp32"))  # healthy scales pass ...
    with pytest.raises(AssertionError):  # ... and the same check rejects the broken ones
        check(make_trace(scaled(params, suffixes, gain), "fp32"))
