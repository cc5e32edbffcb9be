"""Programmatic dependent launch (kernels/launch.py) on the GPU: the mini model's decode with
every kernel launched under PDL equals the run without it bit for bit — tokens, round records and
every cache — for eager launches, one graph per round, the device loop (WHILE node, adaptive
depths in IF nodes) and with expert prefetch on. GPU only (PDL is PTX `griddepcontrol`); the
CPU checks of the kernels' PDL entry are in tests/kernels/test_launch.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from iquestrt.config import RuntimeConfig
from iquestrt.engine import Engine
from iquestrt.snapshot import caches_digest
from reference.depth import AdaptiveDepth, FixedDepth
from reference.speculative import GenerationRequest
from tests.helpers.engine_setup import GREEDY, SAMPLING, rounds_key

pytestmark = pytest.mark.gpu
MINI = Path(__file__).resolve().parents[2] / "models" / "mini"
PROMPT = (490, 290, 263, 434, 1085, 337)
ADAPTIVE = AdaptiveDepth(weights=((0.0, 0.0, 1.0, 0.0, 0.0, 0.0),) * 4, threshold=0.5)


def _run(req, **kw):  # pdl given: its default is on where it can run
    rc = RuntimeConfig(ops="kernels", device="cuda", ring_pad=8, max_positions=512, **kw)
    eng = Engine.from_checkpoint(MINI, rc)
    res = eng.generate(req)
    return res.tokens, rounds_key(res), caches_digest(eng.session.caches)


@pytest.mark.parametrize("mode", [
    dict(policy=FixedDepth(3)),
    dict(policy=FixedDepth(3), graphs=True),
    dict(policy=ADAPTIVE, graphs=True, loop="device"),
    dict(policy=FixedDepth(5), graphs=True, prefetch=False),
], ids=["eager", "graph", "device-loop-adaptive", "graph-depth5-no-prefetch"])
@pytest.mark.parametrize("sampling", [SAMPLING, GREEDY], ids=["sampling", "greedy"])
def test_pdl_changes_no_bit(mode, sampling):
    req = GenerationRequest(PROMPT, 48, sampling, 11)
    off = _run(req, pdl=False, **mode)
    on = _run(req, pdl=True, **mode)
    assert on[0] == off[0]
    assert on[1] == off[1]
    assert on[2] == off[2]
    assert len(off[1]) >= 8
