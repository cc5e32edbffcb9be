"""iquestrt/tp/group.py: vocabulary slices, the multicast switches, the rendezvous settings,
and bounded waits (a rank that never joins, or never reaches a collective, makes the others
fail with TPError within the timeout)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import tp_workers
from tp_harness import free_port, spawn

from iquestrt.tp.group import (
    MULTICAST_OFF,
    TPError,
    TPGroup,
    disable_multicast,
    init_group,
    rendezvous_from_env,
    vocab_slice,
)
from reference.config import ConfigError, preset

CPU = torch.device("cpu")
BOUND_S = 2.0  # the group timeout of the failure test
SLACK_S = 4.0  # allowed beyond it (gloo's store rounds its wait up to the next second)


@pytest.mark.parametrize("vocab,world", [(512, 1), (512, 2), (512, 4), (8192, 8), (160000, 8)])
def test_vocab_slices_tile_the_vocabulary_in_rank_order(vocab, world):
    ids = [i for r in range(world) for i in vocab_slice(vocab, r, world)]
    assert ids == list(range(vocab))
    assert all(len(vocab_slice(vocab, r, world)) == vocab // world for r in range(world))


def test_vocab_slice_errors_are_named():
    with pytest.raises(ValueError, match="vocabulary 510 is not divisible by the world size 4"):
        vocab_slice(510, 0, 4)
    with pytest.raises(ValueError, match="0 <= rank < world, got rank 4, world 4"):
        vocab_slice(512, 4, 4)
    with pytest.raises(ValueError, match="world must be an int"):
        vocab_slice(512, 0, 2.0)


def test_model_vocab_slice_follows_per_rank():
    cfg = preset("iquest-q1")
    for r in range(8):
        got = TPGroup(r, 8, "gloo", CPU, 1.0).model_vocab_slice(cfg)
        assert got == vocab_slice(160000, r, 8) and len(got) == 20000  # 160 000 / 8 rows per rank
    # mini has 2 KV heads: TP4 cannot split it, and the error names the field
    with pytest.raises(ConfigError, match="num_key_value_heads=2 is not divisible by tp=4"):
        TPGroup(0, 4, "gloo", CPU, 1.0).model_vocab_slice(preset("mini"))


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(rank=2, world=2), "rank must be in \\[0, world=2\\)"),
    (dict(world=0), "world must be an int >= 1"),
    (dict(backend="mpi"), "backend must be one of"),
    (dict(backend="nccl"), "backend nccl needs a cuda device"),
    (dict(timeout_s=0.0), "timeout_s must be finite and > 0"),
    (dict(timeout_s=float("inf")), "timeout_s must be finite and > 0"),
])
def test_group_fields_are_validated(kwargs, pattern):
    base = dict(rank=0, world=2, backend="gloo", device=CPU, timeout_s=1.0)
    with pytest.raises(ValueError, match=pattern):
        TPGroup(**{**base, **kwargs})


def test_disable_multicast_sets_the_three_switches():
    env = {"OTHER": "x", "NCCL_NVLS_ENABLE": "0"}
    disable_multicast(env)
    assert env == {"OTHER": "x", **dict(MULTICAST_OFF)}
    assert set(dict(MULTICAST_OFF)) == {"NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                        "NVSHMEM_DISABLE_NVLS"}


@pytest.mark.parametrize("name,value", [("NCCL_NVLS_ENABLE", "1"),
                                        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0"),
                                        ("NVSHMEM_DISABLE_NVLS", "")])
def test_disable_multicast_refuses_a_conflicting_setting(name, value):
    env = {name: value}
    with pytest.raises(TPError, match=f"{name}={value!r}, but NVLink multicast must stay off"):
        disable_multicast(env)
    assert env == {name: value}  # nothing half-set


def test_nccl_rank_without_a_gpu_of_its_own_is_refused(monkeypatch):
    """Two NCCL ranks on one GPU fail deep inside NCCL; init_group names it before joining."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(TPError, match="local rank 1\\) has no GPU of its own: 1 visible"):
        init_group()
    assert not torch.distributed.is_initialized()

def test_rendezvous_from_env():
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    rv = rendezvous_from_env(env)
    assert (rv.rank, rv.world, rv.local_rank, rv.init_method) == (3, 4, 3, "env://")
    assert rendezvous_from_env({**env, "LOCAL_RANK": "1"}).local_rank == 1
    for broken, pattern in [
        ({k: v for k, v in env.items() if k != "RANK"}, "RANK is not set"),
        ({**env, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({**env, "RANK": "4"}, "RANK=4 outside \\[0, 3\\]"),
        ({**env, "MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
        ({**env, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 outside"),
    ]:
        with pytest.raises(TPError, match=pattern):
            rendezvous_from_env(broken)


def test_init_group_wants_all_or_none_of_the_rendezvous_arguments():
    with pytest.raises(ValueError, match="pass all of rank, world, master_addr, master_port"):
        init_group(0, 2)
    with pytest.raises(ValueError, match="master_port must be in \\[1, 65535\\]"):
        init_group(0, 2, master_addr="127.0.0.1", master_port=0)


@pytest.mark.slow
def test_missing_rank_fails_within_the_timeout(tmp_path):
    done = multiprocessing.get_context("spawn").Event()
    spawn(tp_workers.failure_worker, 3, ((free_port(), free_port()), str(tmp_path), BOUND_S,
                                         done), 60.0)
    msg, took = torch.load(tmp_path / "init.pt")
    assert msg is not None and "rank 0 of 2: init_process_group(gloo)" in msg, msg
    assert "did not complete within 2 s" in msg and took < BOUND_S + SLACK_S, (msg, took)
    msg, took = torch.load(tmp_path / "gather.pt")
    assert msg is not None and "rank 0 of 2: the all-gather of candidate keys" in msg, msg
    assert "a peer rank did not reach it" in msg and took < BOUND_S + SLACK_S, (msg, took)


def test_close_group_is_bounded(monkeypatch):
    """A teardown that never returns (NCCL waiting for a live captured graph) fails with the
    cause named after the timeout instead of hanging the process."""
    import threading

    from iquestrt.tp import group as tp_group

    never = threading.Event()
    monkeypatch.setattr(tp_group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(tp_group.dist, "destroy_process_group", never.wait)
    with pytest.raises(TPError, match="did not finish within 0.5 s; a live CUDA graph"):
        tp_group.close_group(0.5)
    never.set()
    finished = []
    monkeypatch.setattr(tp_group.dist, "destroy_process_group", lambda: finished.append(1))
    tp_group.close_group(5.0)
    assert finished == [1]
