"""`iquestrt generate --tp 2` under torchrun — two CPU processes (gloo, twins; GPUs hidden) and,
on a machine with two GPUs, two NCCL ranks with the compiled kernels: rank 0 prints the tokens,
rank 1 nothing; greedy tokens equal the one-process command's or part at a near-tie; without
torchrun the command names how to start it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from flip_check import check_greedy
from tp_harness import free_port

from iquestrt import cli
from iquestrt.files import checkpoint_tokenizer
from qualification import mini_engine
from reference.checkpoint import load_checkpoint

ARGS = ["generate", "--backend", "runtime", "--ops", "twins", "--prompt", "def parse_args(",
        "--max-new-tokens", "16", "--temperature", "0", "--quiet"]


def tokens_of(stdout: str) -> list[int]:
    return [int(t) for t in stdout.strip().splitlines()[0].split()]


def _tp2_tokens(args: list[str], env: dict) -> list[int]:
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m",
           "iquestrt.cli", *args, "--tp", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    line = res.stdout.strip().splitlines()[0]
    assert res.stdout.count(line) == 1, "only rank 0 prints"
    return tokens_of(res.stdout)


def _check_against_one_process(args: list[str], tp: list[int], capsys) -> None:
    assert cli.main(args) == 0
    one = tokens_of(capsys.readouterr().out)
    ck = load_checkpoint(mini_engine.MINI)
    prompt = checkpoint_tokenizer(ck.directory).encode("def parse_args(").ids
    print("\n  " + (check_greedy(ck, prompt, tp, one) or "TP2 == one process"))


@pytest.mark.slow
def test_generate_tp2_under_torchrun(capsys):
    tp = _tp2_tokens(ARGS, {**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # gloo on the CPU
    _check_against_one_process(ARGS, tp, capsys)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one per NCCL rank)")
def test_generate_tp2_nccl_kernels(capsys):
    args = [a if a != "twins" else "kernels" for a in ARGS]
    tp = _tp2_tokens(args, dict(os.environ))
    _check_against_one_process(args, tp, capsys)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one per NCCL rank)")
def test_generate_tp2_nccl_peer_reduction_equals_all_gather():
    """--tp-reduce peer on two GPUs: the tails read the peer's ring slots in symmetric memory;
    the same partials in the same order as the all-gather, so the same greedy tokens."""
    args = [a if a != "twins" else "kernels" for a in ARGS]
    gathered = _tp2_tokens(args, dict(os.environ))
    peer = _tp2_tokens([*args, "--tp-reduce", "peer"], dict(os.environ))
    assert peer == gathered


def test_tp_without_torchrun_says_how(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main([*ARGS, "--tp", "2"]) == cli.EXIT_USAGE
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err


def test_tp_reduce_without_tp_is_refused(capsys):
    assert cli.main([*ARGS, "--tp-reduce", "peer"]) == cli.EXIT_USAGE
    assert "--tp-reduce peer: applies to --tp >= 2" in capsys.readouterr().err
