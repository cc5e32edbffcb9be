"""Whole requests on 2 gloo ranks (iquestrt/tp/engine.py, twins, the trained mini model): every
rank emits the same tokens and round records (sharded sampling gives each rank the same token, no
broadcast); greedy decoding equals the single-rank engine token for token, or parts only at a
near-tie (tests/tp/flip_check.py); with sampling the tokens may part where the target's slightly
different logits reorder two near-equal served probabilities (the draw order is by probability),
so only the ranks' agreement is exact there."""

from __future__ import annotations

import pytest
import torch
import tp_workers
from flip_check import check_greedy
from tp_harness import free_port, spawn

from iquestrt.config import RuntimeConfig
from iquestrt.engine import Engine
from iquestrt.tp.engine import TPEngine
from iquestrt.tp.group import TPGroup
from iquestrt.weights import from_checkpoint
from qualification import mini_engine
from reference.checkpoint import load_checkpoint
from reference.config import SamplingDefaults
from reference.depth import FixedDepth
from reference.speculative import GenerationRequest

PROMPT_TOKENS, NEW = 64, 48
GREEDY, SAMPLED = (0.0, 20, 1.0), (1.0, 20, 0.95)


def rcfg(cap: int, **kw) -> RuntimeConfig:
    return RuntimeConfig(ops="twins", ring_pad=8, max_positions=cap, policy=FixedDepth(3),
                         prefetch=False, **kw)


@pytest.fixture(scope="module")
def prompt():
    return list(mini_engine.prompts(PROMPT_TOKENS)[0].ids[:PROMPT_TOKENS])


def run_tp(prompt, sampling, tmp) -> list[dict]:
    spawn(tp_workers.generate_worker, 2, (2, free_port(), str(tmp), 120.0, str(mini_engine.MINI),
                                          prompt, NEW, sampling, 7), 400.0)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


def single(prompt, sampling):
    ck = load_checkpoint(mini_engine.MINI)
    cap = PROMPT_TOKENS + NEW + 16
    eng = Engine(from_checkpoint(ck, "cpu", cap), rcfg(cap))
    return eng.generate(GenerationRequest(tuple(prompt), NEW, SamplingDefaults(*sampling), 7))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_ranks_agree_and_greedy_equals_one_rank(prompt, sampling, tmp_path):
    r = run_tp(prompt, sampling, tmp_path)
    assert r[0]["tokens"] == r[1]["tokens"] and r[0]["rounds"] == r[1]["rounds"]
    assert len(r[0]["tokens"]) == NEW and len(r[0]["rounds"]) >= 10
    if sampling == GREEDY:
        line = check_greedy(load_checkpoint(mini_engine.MINI), prompt, r[0]["tokens"],
                            single(prompt, sampling).tokens)
        print(f"\n  {line or 'greedy TP2 == TP1 for every token'}")


def test_tp_engine_refuses_what_it_cannot_do():
    ck = load_checkpoint(mini_engine.MINI)
    w = from_checkpoint(ck, "cpu", 256)
    with pytest.raises(ValueError, match="use Engine"):
        TPEngine(w, rcfg(256), TPGroup(0, 1, "gloo", torch.device("cpu"), 10.0))
