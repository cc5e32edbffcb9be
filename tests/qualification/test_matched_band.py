"""Gate 1's matched band on the CPU: its reference in the candidate's context is the matched
reference bit for bit when the candidate is the twins engine, the band passes the twins and
fails planted defects, and its pieces (pins, forced keys, rounding noise) do what they say.
The kernels path is the GPU's
(tests/qualification/test_qualification.py::test_runtime_gate_on_the_gpu…).

Synthetic tiny E4M3 model (runtime_gate.TINY: 40 tokens, rings wrap), twins engine."""

import dataclasses

import pytest
import torch

from qualification import matched_band, rounding_noise, runtime_gate
from qualification.gate1_power import Row, smallest, table
from qualification.pinned_routes import ForcedKV, PinnedRoutes
from qualification.plants import Plant, planted
from reference import ops as ref_ops


@pytest.fixture(scope="module")
def tiny():
    g = dataclasses.replace(runtime_gate.TINY, prompts=1)
    s = runtime_gate.setup(g, "twins")
    pr = runtime_gate.PromptRefs(s, g, s.prompts[0])
    return g, s, pr


def _traced(s, g, plant=None):
    with planted(s.engine, plant):
        return runtime_gate.candidate(s, s.prompts[0][: g.length], traced=True)


@pytest.mark.slow
def test_context_reference_is_the_matched_reference_for_the_twins(tiny):
    """Pins equal to the twins' experts and the twins' own keys give the plain matched logits
    bit for bit; a changed key at position 5 moves the later positions only."""
    g, s, pr = tiny
    c = _traced(s, g)
    assert torch.equal(c.logits, pr.want)
    m = s.refs["matched"]
    model = PinnedRoutes(m.cfg, m.p, c.routes)
    toks, T = s.prompts[0][: g.length], g.length
    n_layers = m.cfg.target.num_hidden_layers
    got = model.target(toks, torch.arange(T), ForcedKV(n_layers, c.kv)).logits
    assert torch.equal(got, pr.want) and model.differing == []
    kv = dict(c.kv)
    k0, v0 = kv[0]
    k0 = k0.clone()
    k0[5] = -k0[5]
    kv[0] = (k0, v0)
    moved = model.target(toks, torch.arange(T), ForcedKV(n_layers, kv)).logits
    changed = (moved != pr.want).any(-1).nonzero().flatten().tolist()
    assert changed and min(changed) == 6, changed  # position 5 uses its own key


@pytest.mark.slow
def test_pins_are_taken_and_their_gaps_recorded(tiny):
    """Another expert forced at one (position, layer): the pinned model uses it (other logits)
    and records a positive gap there first (the later pins then differ from its own choices
    too: its hidden states took the other expert)."""
    g, s, pr = tiny
    c = _traced(s, g)
    m = s.refs["matched"]
    layer = sorted(c.routes)[0]
    routes = {k: v.clone() for k, v in c.routes.items()}
    own = set(routes[layer][3].tolist())
    other = next(e for e in range(m.cfg.target.num_experts) if e not in own)
    routes[layer][3, -1] = other
    model = PinnedRoutes(m.cfg, m.p, routes)
    toks = s.prompts[0][: g.length]
    got = model.target(toks, torch.arange(g.length), None).logits
    assert not torch.equal(got[3], pr.want[3])
    first = model.differing[0]
    assert (first.position, first.layer) == (3, layer) and first.gap > 0, model.differing[:3]
    assert torch.equal(got[:3], pr.want[:3])


@pytest.mark.parametrize("plant", [None, Plant("no_sink"), Plant("quant_scale", 0.05, 2)],
                         ids=["none", "no_sink", "scale5pct"])
@pytest.mark.slow
def test_matched_band_passes_the_twins_and_fails_plants(tiny, plant):
    g, s, pr = tiny
    c = _traced(s, g, plant)
    mb = matched_band.run(pr.band(), c.logits, c.routes, c.kv)
    if plant is None:
        assert mb.ok and mb.worst == 0.0 and not mb.outside, mb.evidence
    else:
        assert not mb.ok and mb.worst > 3.0, mb.evidence


def test_rounding_noise_perturbs_then_restores():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    clean = ref_ops.linear(x, w)
    real = ref_ops.round_to
    with rounding_noise.noisy(2.0**-20, 3):
        noisy = ref_ops.linear(x, w)
    assert ref_ops.round_to is real
    rel = float(((noisy - clean).abs() / clean.abs().clamp_min(1e-30)).max())
    assert 0 < rel < 2.0**-19, rel
    with pytest.raises(ValueError, match="eps must be in"):
        with rounding_noise.noisy(0.0, 3):
            pass
    with pytest.raises(RuntimeError):
        with rounding_noise.noisy(2.0**-20, 3):
            raise RuntimeError("inside")
    assert ref_ops.round_to is real


def test_plants_check_their_arguments_and_restore_the_ops(tiny):
    g, s, pr = tiny
    with pytest.raises(ValueError, match="Plant.kind"):
        Plant("sinkless")
    with pytest.raises(ValueError, match="whole slots"):
        Plant("window", 0.5)
    real = s.engine.ops
    with pytest.raises(ValueError, match="not an MoE layer"):
        with planted(s.engine, Plant("quant_scale", 0.01, 0)):
            pass
    with planted(s.engine, Plant("no_sink")):
        assert s.engine.ops is not real and s.engine.target.ops is s.engine.ops
    assert s.engine.ops is real and s.engine.target.ops is real and s.engine.draft.ops is real


def test_power_summary_names_the_smallest_detected_size():
    def row(kind, size, m, f):
        return Row(f"{kind} {size}", kind, size, m, f, None, 0.5, 1.0)

    rows = [row("none", 0.0, False, False), row("quant_scale", 0.001, False, False),
            row("quant_scale", 0.01, True, False), row("quant_scale", 0.1, True, True),
            row("window", -1, False, False)]
    least = smallest(rows)
    assert least["quant_scale"] == {"matched": "1.00%", "fp32": "10.00%"}
    assert least["window"] == {"matched": "not detected", "fp32": "not detected"}
    assert "| quant_scale 0.01 | detects | passes (50%) |" in table(rows, "twins")
