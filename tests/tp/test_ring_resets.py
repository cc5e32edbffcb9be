"""iquestrt/tp/ring_resets.py: the rings are re-armed at each request's start and after a graph
capture's _prepare, never after an eager one, and engines without rings are left alone."""

from types import SimpleNamespace

from iquestrt.tp.ring_resets import RingResets


class Base:
    def __init__(self, graphs: bool):
        self.rcfg = SimpleNamespace(graphs=graphs)
        self.calls: list[str] = []

    def generate(self, req, on_round=None, on_tokens=None):
        self.calls.append("generate")
        return self._prepare(None, None)

    def _prepare(self, st, hidden):
        self.calls.append("prepare")
        return "launcher"


class Rings:
    def __init__(self, log: list[str]):
        self.log = log

    def reset(self, group):
        self.log.append(f"reset:{group}")


class Eng(RingResets, Base):
    def __init__(self, graphs: bool, with_rings: bool = True):
        super().__init__(graphs)
        self.rings = Rings(self.calls) if with_rings else None

    def ring_set(self):
        return self.rings, "g0"


def test_graphs_re_arm_at_the_start_and_after_the_capture():
    e = Eng(graphs=True)
    assert e.generate("req") == "launcher"
    assert e.calls == ["reset:g0", "generate", "prepare", "reset:g0"]


def test_eager_re_arms_only_at_the_start():
    e = Eng(graphs=False)
    e.generate("req")
    assert e.calls == ["reset:g0", "generate", "prepare"]


def test_without_rings_nothing_is_reset():
    e = Eng(graphs=True, with_rings=False)
    e.generate("req")
    assert e.calls == ["generate", "prepare"]
