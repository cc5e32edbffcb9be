"""kernels.sampler.values.DeviceSampling: the sampler reading temperature / top-p from the device
gives the bits of the scalar path, for sample and for the TP pair topk_candidates +
sample_from_candidates; `update` retargets the same buffers (and a captured graph) to another
request of the same shape and refuses another shape."""

from __future__ import annotations

import pytest
import torch

from iquestrt.capture import graph_capture
from kernels.sampler import SamplerLaunch, sample, sample_from_candidates, topk_candidates
from kernels.sampler.values import DeviceSampling
from qualification.tolerances import check
from reference.config import SamplingDefaults as SP
from reference.twins.sampler import sample_ref
from tests.kernels.test_sampler import make_logits

V = 1000
CFG = SamplerLaunch(256, 4, 4)
PARAMS = [SP(), SP(0.7, 5, 0.9), SP(1.3, 20, 1.0), SP(0.0, 20, 0.95), SP(1.0, 20, 0.5)]


def same(a, b, what: str) -> None:
    for name, x, y in zip(("tokens", "ids", "probs"), a, b, strict=True):
        assert x.dtype == y.dtype, f"{what}: {name}"
        check(x.cpu(), y.cpu(), "kernels.sampler.device_values", "exact")


def run(x, params, device, seed=77, shift=0):
    pos = torch.arange(x.shape[0], dtype=torch.int64, device=device) + shift
    return sample(x.to(device), params, seed, pos, config=CFG)


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.slow
def test_device_values_equal_the_scalar_path(p, device):
    x = make_logits(4, V, 3, "ties")
    same(run(x, DeviceSampling.create(p, V, device), device), run(x, p, device), str(p))


@pytest.mark.slow
def test_update_retargets_the_same_buffers(device):
    x = make_logits(4, V, 5, "normal")
    ds = DeviceSampling.create(SP(1.0, 20, 0.95), V, device)
    first = run(x, ds, device)
    ds.update(SP(0.4, 20, 0.6), V)
    second = run(x, ds, device)
    same(second, run(x, SP(0.4, 20, 0.6), device), "after update")
    assert not torch.equal(first.probs.cpu(), second.probs.cpu()), "the values were not read"
    with pytest.raises(ValueError, match="another request shape"):
        ds.update(SP(1.0, 8, 0.95), V)
    with pytest.raises(ValueError, match="another request shape"):
        ds.update(SP(0.0, 20, 0.95), V)
    with pytest.raises(ValueError, match="temperature"):
        DeviceSampling.create(SP(-1.0, 20, 0.95), V, device)


@pytest.mark.slow
def test_tp_pair_reads_device_values(device):
    x = make_logits(3, V, 9, "ties").to(device)
    p = SP(0.8, 20, 0.9)
    ds = DeviceSampling.create(p, V, device)
    pos = torch.arange(3, dtype=torch.int64, device=device)
    outs = []
    for params in (p, ds):
        keys = torch.stack([topk_candidates(x[:, a:b].contiguous(), params, a, V, config=CFG)
                            for a, b in ((0, 500), (500, V))], 1)  # [R, 2, KP]
        outs.append(sample_from_candidates(keys, params, 5, pos, vocab=V, config=CFG))
    same(outs[1], outs[0], "TP pair")
    tok, ids, _ = sample_ref(x.cpu(), p, 5, pos.cpu())
    assert torch.equal(outs[1].tokens.cpu(), tok) and torch.equal(outs[1].ids.cpu(), ids)


@pytest.mark.gpu
def test_one_captured_graph_serves_requests_of_one_shape(device):
    R, V_big = 8, 160000
    x = make_logits(R, V_big, 1, "normal").to(device)
    pos = torch.arange(R, dtype=torch.int64, device=device)
    seed = torch.tensor([5], dtype=torch.int64, device=device)
    ds = DeviceSampling.create(SP(), V_big, device)
    out = sample(x, ds, seed, pos)  # compile
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        sample(x, ds, seed, pos, out=out)
    for p, s in ((SP(0.6, 20, 0.8), 9), (SP(1.5, 20, 1.0), 2**40), (SP(1.0, 20, 0.95), 3)):
        ds.update(p, V_big)
        seed.fill_(s)
        graph.replay()
        torch.cuda.synchronize()
        tok, ids, _ = sample_ref(x.cpu(), p, s, pos.cpu())
        assert torch.equal(out.tokens.cpu(), tok) and torch.equal(out.ids.cpu(), ids), p
