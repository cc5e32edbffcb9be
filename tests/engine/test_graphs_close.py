"""iquestrt/graphs.py: closing a launcher frees its captured graph (NCCL's communicator can only
be destroyed once no graph that captured its collectives is alive); Engine.close() closes the
current launcher and a later request builds a new one."""

from __future__ import annotations

import pytest

from iquestrt.config import RuntimeConfig
from iquestrt.engine import Engine
from iquestrt.graphs import Launcher
from iquestrt.weights import from_checkpoint
from reference.checkpoint import load_checkpoint
from reference.depth import FixedDepth
from reference.speculative import GenerationRequest
from tests.helpers.engine_setup import GREEDY, make_ckpt


class FakeGraph:
    def __init__(self):
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1


def test_closing_a_launcher_resets_its_graph_once():
    g = FakeGraph()
    launcher = Launcher(lambda: None, program=None, graph=g)
    launcher.close()
    launcher.close()
    assert g.resets == 1 and launcher.graph is None


@pytest.mark.slow
def test_engine_close_drops_the_launcher_and_the_next_request_rebuilds(tmp_path):
    ck = load_checkpoint(make_ckpt(tmp_path, "synthetic"))
    rcfg = RuntimeConfig(ops="twins", ring_pad=8, max_positions=64, policy=FixedDepth(2),
                         prefetch=False)
    eng = Engine(from_checkpoint(ck, "cpu", 64), rcfg)
    req = GenerationRequest((1, 2, 3, 4, 5), 8, GREEDY, 3)
    first = eng.generate(req).tokens
    assert eng.programs.launcher is not None and eng.programs.built == 1
    eng.close()
    assert eng.programs.launcher is None
    assert eng.generate(req).tokens == first and eng.programs.built == 2
