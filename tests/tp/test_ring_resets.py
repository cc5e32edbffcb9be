"""iquestrt/tp/ring_resets.py: as an engine observer the rings are re-armed at each request's
start and after a graph capture's prepare phase, never after an eager one, and engines without
rings are left alone. The phases are nested by Engine's own wrapping (Engine._observed), as
generate nests them: request( … prepare( … ) … )."""

from types import SimpleNamespace

from iquestrt.engine import Engine
from iquestrt.engine_parts import EngineObserver
from iquestrt.tp.ring_resets import RingResets


class Rings:
    def __init__(self, log: list[str]):
        self.log = log

    def reset(self, group):
        self.log.append(f"reset:{group}")


class Tag(EngineObserver):
    """An observer after RingResets: it must see the phases from outside."""

    def __init__(self, log):
        self.log = log

    def prepare(self, eng, st, run):
        self.log.append("tag<")
        out = run()
        self.log.append(">tag")
        return out


def _generate(graphs: bool, with_rings: bool = True, more=()):
    calls: list[str] = []
    obs = (RingResets(Rings(calls) if with_rings else None, "g0"), *(m(calls) for m in more))
    eng = SimpleNamespace(rcfg=SimpleNamespace(graphs=graphs),
                          parts=SimpleNamespace(observers=obs))

    def prepare():
        calls.append("prepare")
        return "launcher"

    def request():
        calls.append("generate")
        return Engine._observed(eng, "prepare", prepare, None)

    assert Engine._observed(eng, "request", request) == "launcher"
    return calls


def test_graphs_re_arm_at_the_start_and_after_the_capture():
    assert _generate(True) == ["reset:g0", "generate", "prepare", "reset:g0"]


def test_eager_re_arms_only_at_the_start():
    assert _generate(False) == ["reset:g0", "generate", "prepare"]


def test_without_rings_nothing_is_reset():
    assert _generate(True, with_rings=False) == ["generate", "prepare"]


def test_the_first_observer_is_innermost():
    assert _generate(True, more=(Tag,)) == ["reset:g0", "generate", "tag<", "prepare",
                                            "reset:g0", ">tag"]
