"""The engine is composed from the parts it is given (iquestrt/engine_parts.py): the engines
built for other uses (tensor parallelism, the rank benchmark, snapshots, experiments) are
constructors of parts, never overrides of Engine's methods or patches after construction, and
a request runs its phases through the observers in order. On the twins engine (CPU)."""

from __future__ import annotations

import inspect

import pytest

from benchmarks.rank.engine import RankEngine
from iquestrt.config import RuntimeConfig
from iquestrt.engine import Engine
from iquestrt.engine_parts import EngineObserver, EngineParts
from iquestrt.experiment.engine import ExperimentEngine
from iquestrt.snapshot import SnapshotEngine
from iquestrt.tp.engine import TPEngine
from iquestrt.weights import from_checkpoint
from reference.checkpoint import load_checkpoint
from reference.correlated import make_ckpt
from reference.speculative import GenerationRequest

ENGINES = [TPEngine, RankEngine, SnapshotEngine, ExperimentEngine]


def overrides(cls: type) -> list[str]:
    """Engine's methods (beyond __init__) that cls or a class between it and Engine redefines."""
    out = []
    for klass in cls.__mro__[: cls.__mro__.index(Engine)]:
        out += [f"{klass.__name__}.{n}" for n, v in vars(klass).items()
                if n in vars(Engine) and n != "__init__" and callable(v)]
    return out


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_engines_compose_parts_and_override_nothing(cls):
    assert overrides(cls) == []


def test_the_check_finds_an_override():
    class Patched(SnapshotEngine):
        def _prepare(self, st, hidden):
            raise AssertionError

    assert overrides(Patched) == ["Patched._prepare"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    ck = load_checkpoint(make_ckpt(tmp_path_factory.mktemp("corr"), "correlated"))
    return from_checkpoint(ck, "cpu", 256)


class Trace(EngineObserver):
    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def _wrap(self, phase: str, run):
        self.log.append(f"{self.name}.{phase}<")
        out = run()
        self.log.append(f">{self.name}.{phase}")
        return out

    def request(self, eng, run):
        return self._wrap("request", run)

    def prepare(self, eng, st, run):
        assert eng.session is st and st.device is None  # before the device state exists
        return self._wrap("prepare", run)

    def loop(self, eng, st, run):
        assert st.device is not None and st.result.rounds == []
        self._wrap("loop", run)
        assert st.result.rounds  # the loop ran the rounds


def test_a_request_runs_its_phases_through_the_observers(weights):
    rcfg = RuntimeConfig(ops="twins", max_positions=256)
    log: list[str] = []
    parts = EngineParts.default(weights, rcfg).with_observers(Trace("a", log), Trace("b", log))
    eng = Engine(weights, rcfg, parts=parts)
    req = GenerationRequest((1, 2, 3, 4, 5), 6, weights.cfg.sampling, 0)
    plain = Engine(weights, rcfg).generate(req)
    assert eng.generate(req).tokens == plain.tokens  # observers change no bit
    assert log == ["b.request<", "a.request<", "b.prepare<", "a.prepare<", ">a.prepare",
                   ">b.prepare", "b.loop<", "a.loop<", ">a.loop", ">b.loop", ">a.request",
                   ">b.request"]


def test_every_part_is_the_engines_own(weights):
    rcfg = RuntimeConfig(ops="twins", max_positions=256)
    eng = SnapshotEngine(weights, rcfg)
    assert eng.ops is eng.target.ops is eng.draft.ops is eng.parts.ops
    assert eng.parts.prefill is eng.replay
    real = eng.swap_ops("wrapper")
    assert eng.ops == eng.target.ops == eng.draft.ops == "wrapper" and real is eng.parts.ops
    with pytest.raises(ValueError, match="prefetcher inside parts"):
        Engine(weights, rcfg, prefetcher=object(), parts=EngineParts.default(weights, rcfg))
    assert "parts" in inspect.signature(Engine).parameters
