"""Sharded sampling without a token broadcast (iquestrt/tp/sampling.py) on 2 and 4 gloo ranks:
every rank's tokens, served ids and probabilities equal the single-process kernel sampler
(kernels path) and the single-process twin (twins path) bit for bit; broken variants fail the
same comparison; bad inputs are named before any collective."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import tp_workers
from tp_harness import (
    BROKEN_CASES,
    cases,
    free_port,
    logits,
    mismatch,
    sampling_args,
    spawn,
    tie_boundary,
)

from iquestrt.ops import Live
from iquestrt.tp.group import TPError, TPGroup
from iquestrt.tp.sampling import (
    EMPTY,
    ShardedSampler,
    TwinShardSteps,
    gather_keys,
    key_ids,
    key_values,
    make_sharded_sampler,
    order_keys,
)
from kernels import sampler as k_sampler
from kernels.sampler.values import DeviceSampling
from reference.config import SamplingDefaults
from reference.rng import Purpose
from reference.twins.sampler import sample_ref

RANK_TIMEOUT_S = 60.0  # bound on each collective while a peer interprets its kernels
SPAWN_TIMEOUT_S = 300.0
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def run(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"tp{world}")
    spawn(tp_workers.sampling_worker, world, (world, free_port(), str(out), RANK_TIMEOUT_S),
          SPAWN_TIMEOUT_S)
    return world, [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _twin_ref(case, world):
    seed, pos = sampling_args(case)
    return sample_ref(logits(case, world), case.params, seed, pos, Purpose.TARGET_SAMPLE,
                      n_live=case.live)


@pytest.mark.slow
def test_every_rank_equals_single_process(run):
    world, res = run
    for i, case in enumerate(cases(world)):
        want = {"kernels": res[i % world]["ref_kernels"][i], "twins": _twin_ref(case, world)}
        for r in range(world):
            for ops in ("kernels", "twins"):
                bad = mismatch(res[r][ops][i], want[ops], case.live)
                assert not bad, f"tp{world} rank {r} {ops} case {i} {case}: {bad}"
                assert not mismatch(res[r][ops][i], res[0][ops][i], case.live)
        if case.ties:  # the maximum tied across a boundary leads, lower id first
            w = 1 if case.temperature == 0 else min(2, case.top_k)
            ties = [[tie_boundary(case, world, r) - 1 + j for j in range(w)]
                    for r in range(case.live)]
            assert res[0]["kernels"][i][1][: case.live, :w].tolist() == ties


def test_local_keys_of_twin_equal_kernel(run):
    world, res = run
    for i, case in enumerate(cases(world)):
        for r in range(world):
            k, t = res[r]["keys_kernels"][i], res[r]["keys_twins"][i]
            assert torch.equal(k[: case.live], t[: case.live]), f"rank {r} case {i}"


def test_broken_variants_fail_the_same_comparison(run):
    world, res = run
    for i in BROKEN_CASES:
        case = cases(world)[i]
        want = res[i % world]["ref_kernels"][i]
        assert mismatch(res[world - 1]["broken_offset"][i], want, case.live), (
            f"case {i}: a rank with vocab offset 0 went unnoticed")
        # Rank 0 adds 0 to the seed; every other rank's uniforms differ.
        for r in range(1, world):
            if case.temperature > 0:
                assert mismatch(res[r]["broken_rng"][i], want, case.live), (
                    f"case {i} rank {r}: uniforms keyed by rank went unnoticed")
                assert mismatch(res[r]["broken_rng"][i], res[0]["broken_rng"][i], case.live)
        assert not mismatch(res[0]["broken_rng"][i], want, case.live)


def test_bad_input_named_on_every_rank_and_group_survives(run):
    world, res = run
    case = cases(world)[1]
    for r in range(world):
        msg = res[r]["bad_input"]
        assert msg is not None and "logits must be [R >= 1, Vs=" in msg and f"rank {r}" in msg
        assert not mismatch(res[r]["after_bad"], _twin_ref(case, world), case.live)


def test_ranks_force_multicast_off(run):
    _, res = run
    for r in res:
        assert r["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                            "NVSHMEM_DISABLE_NVLS": "1"}


# --- in-process: one rank without a process group ------------------------------------------


def _group(rank=0, world=1):
    return TPGroup(rank, world, "gloo", CPU, 5.0)


def _cpu_sampler(ops: str, group: TPGroup, vocab: int) -> ShardedSampler:
    """The kernels on these CPU tensors run interpreted; where a GPU compiles them the interpreter
    is off and make_sharded_sampler refuses (the two-GPU NCCL test in test_tp_cli.py covers the
    compiled steps)."""
    if ops == "kernels" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels on CPU tensors need the interpreter, off on a GPU machine")
    return make_sharded_sampler(ops, group, vocab)


@pytest.mark.parametrize("device_values", [False, True], ids=["host", "device_values"])
@pytest.mark.parametrize("ops", ["kernels", "twins"])
@pytest.mark.slow
def test_world_one_equals_single_process(ops, device_values):
    """Also with the sampling values and the seed on the device (DeviceSampling, int64 bits):
    the engine's rounds pass them so."""
    case = cases(1)[1]
    x, (seed, pos) = logits(case, 1), sampling_args(case)
    params, s = case.params, seed
    if device_values:
        params = DeviceSampling.create(case.params, case.vocab, CPU)
        s = torch.tensor([seed - 2**64 if seed >= 2**63 else seed], dtype=torch.int64)
    got = _cpu_sampler(ops, _group(), case.vocab).sample(
        x, params, s, pos, Purpose.TARGET_SAMPLE, Live.of(case.live, "cpu"))
    if ops == "kernels":
        want = k_sampler.sample(x, case.params, seed, pos, Purpose.TARGET_SAMPLE)
    else:
        want = sample_ref(x, case.params, seed, pos, Purpose.TARGET_SAMPLE)
    assert not mismatch(got, want, case.live)


def test_order_keys_round_trip_and_order():
    z = torch.tensor([[1.5, -0.0, 0.0, float("-inf"), -2.25, 1.5]])  # [1, 6]
    ids = torch.tensor([[7, 3, 2, 9, 0, 5]])
    keys = order_keys(z, ids)
    assert torch.equal(key_ids(keys), ids)
    assert torch.equal(key_values(keys), torch.where(z == 0, 0.0, z))  # −0.0 read back as +0.0
    # descending keys = (z desc, id asc): 1.5@5, 1.5@7, 0@2, 0@3, −2.25@0, −inf@9
    assert key_ids(keys.sort(descending=True).values).tolist() == [[5, 7, 2, 3, 0, 9]]
    assert (keys > EMPTY).all()


def test_twin_rows_beyond_live_are_empty_and_padded():
    case = cases(2)[3]  # R = 4, n = 3
    x = logits(case, 2)[:, : case.vocab // 2].contiguous()
    keys = TwinShardSteps().local_keys(x, case.params, 0, case.vocab, Live.of(case.live, "cpu"))
    assert (keys[case.live :] == EMPTY).all() and (keys[: case.live] != EMPTY).any()


def test_gather_without_process_group_is_named():
    with pytest.raises(TPError, match="no process group"):
        gather_keys(_group(0, 2), torch.zeros(2, 32, dtype=torch.int64))


def _bad_inputs():
    x = torch.zeros(3, 256)
    pos = torch.arange(3)
    p = SamplingDefaults(1.0, 20, 0.95)
    tp = Purpose.TARGET_SAMPLE
    live = Live.of(3, "cpu")
    return [
        ("logits must be a 2-D", (x.double(), p, 1, pos, tp, live, 0)),
        ("logits must be \\[R >= 1, Vs=256\\]", (torch.zeros(3, 512), p, 1, pos, tp, live, 0)),
        ("unit column stride", (torch.zeros(256, 3).t(), p, 1, pos, tp, live, 0)),
        ("live rows must be one count in \\[1, R=3\\]", (x, p, 1, pos, tp, Live.of(4, "cpu"), 0)),
        ("live must be an iquestrt.ops.Live", (x, p, 1, pos, tp, 3, 0)),
        ("params.top_k", (x, SamplingDefaults(1.0, 600, 0.95), 1, pos, tp, live, 0)),
        ("params.top_k=0", (x, SamplingDefaults(1.0, 0, 0.95), 1, pos, tp, live, 0)),
        ("params.top_p", (x, SamplingDefaults(1.0, 20, 1.5), 1, pos, tp, live, 0)),
        ("params.temperature", (x, SamplingDefaults(-1.0, 20, 0.9), 1, pos, tp, live, 0)),
        ("seed must be an int", (x, p, -1, pos, tp, live, 0)),
        ("seed tensor must hold one", (x, p, torch.zeros(2, dtype=torch.int64), pos, tp, live,
                                       0)),
        ("positions must be \\[R=3\\]", (x, p, 1, torch.arange(4), tp, live, 0)),
        ("positions must be a 1-D", (x, p, 1, pos.float(), tp, live, 0)),
        ("purpose must be", (x, p, 1, pos, 7, live, 0)),
        ("index must be", (x, p, 1, pos, tp, live, 2**32)),
    ]


@pytest.mark.parametrize("ops", ["kernels", "twins"])
def test_bad_inputs_named_before_the_collective(ops):
    # rank 1 of 2 with no process group: reaching the all-gather would raise TPError instead.
    smp = _cpu_sampler(ops, _group(1, 2), 512)
    for pattern, args in _bad_inputs():
        with pytest.raises(ValueError, match=pattern):
            smp.sample(*args[:6], index=args[6])
    x, p, seed, pos, tp, live, _ = _bad_inputs()[0][1]
    with pytest.raises(TPError, match="no process group"):  # the good call reaches it
        smp.sample(x.float(), p, seed, pos, tp, live)


def test_sampler_construction_errors(monkeypatch):
    with pytest.raises(ValueError, match="vocabulary 510 is not divisible by the world size 4"):
        make_sharded_sampler("twins", _group(0, 4), 510)
    with pytest.raises(ValueError, match="unknown ops 'fast'"):
        make_sharded_sampler("fast", _group(), 512)
    with pytest.raises(ValueError, match="steps"):
        ShardedSampler(_group(), 512, object())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_sharded_sampler("kernels", _group(), 512)


def test_twin_refuses_what_the_reference_refuses():
    smp = make_sharded_sampler("twins", _group(), 64)
    x = torch.zeros(1, 64)
    x[0, 5] = float("nan")
    args = (SamplingDefaults(), 1, torch.arange(1), Purpose.TARGET_SAMPLE, Live.of(1, "cpu"))
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        smp.sample(x, *args)
    big = torch.full((1, 64), 3e38)
    hot = dataclasses.replace(SamplingDefaults(), temperature=0.5)
    with pytest.raises(ValueError, match="overflows fp32"):
        smp.sample(big, hot, *args[1:])
