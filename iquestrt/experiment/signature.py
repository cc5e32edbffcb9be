"""What an arm's round program launches, to check that two arms really run different programs
(an ineffective substitution must not pass as an optimization).

Recorded: every call into the engine's ops table (the target's, the draft's and the round's own
calls: kernels or twins) and into the expert prefetcher, each as its name with the shapes and
dtypes of its tensor arguments and the values of its other arguments (ints, floats, flags,
sampling settings, weight/cache layouts), in call order. Tensor contents are not recorded.
  * graphs on (a CUDA device): the calls made while RoundPrograms captures the round's graph —
    the warm-up run on the side stream and the captured run —, i.e. the launches the captured
    graph replays. Torch ops issued by iquestrt/round.py itself (where, index_copy, stack …) are
    not in the ops table and not recorded.
  * graphs off: the calls of the request's first round, launched eagerly. On a CPU the engine
    ends a skipped adaptive depth on the host, so there the first round's data decides how many
    depths it records.
There is no readback of a captured graph's nodes: the sequence is recorded on the host while the
program runs.

Dimension letters: none (strings).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch

NO_GRAPHS_ON_DEVICE = "no graphs on this device"


def _sig(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    if isinstance(x, enum.Enum):
        return str(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        inner = ",".join(f"{f.name}={_sig(getattr(x, f.name))}" for f in dataclasses.fields(x))
        return f"{type(x).__name__}({inner})"
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(_sig(y) for y in x) + "]"
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)
    return type(x).__name__


class _Recorder:
    """Stands in for an ops table (or the prefetcher) while a round is recorded."""

    def __init__(self, inner, name: str, log: list[str]):
        self._inner, self._name, self._log = inner, name, log

    def __getattr__(self, attr: str):
        fn = getattr(self._inner, attr)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            parts = [_sig(a) for a in args] + [f"{k}={_sig(v)}" for k, v in sorted(kwargs.items())]
            self._log.append(f"{self._name}.{attr}({', '.join(parts)})")
            return fn(*args, **kwargs)

        return call


@contextmanager
def recording(engine, log: list[str]):
    """Route the engine's ops-table and prefetcher calls through recorders while inside."""
    pre = engine.target.prefetcher
    ops = engine.swap_ops(_Recorder(engine.ops, "ops", log))
    if pre is not None:
        engine.target.prefetcher = _Recorder(pre, "prefetch", log)
    try:
        yield
    finally:
        engine.swap_ops(ops)
        engine.target.prefetcher = pre


@dataclass(frozen=True)
class ProgramSignature:
    captured: bool  # True: recorded while a CUDA graph was captured
    calls: tuple[str, ...]

    @property
    def digest(self) -> str:
        return hashlib.sha256("\n".join(self.calls).encode()).hexdigest()

    def as_dict(self) -> dict:
        return {"captured": self.captured, "calls": len(self.calls), "sha256": self.digest}


class FirstRoundRecorder:
    """The eager round program, recording its first call into `done(signature)`."""

    def __init__(self, engine, program, done):
        self.engine, self.program, self.done = engine, program, done

    def __call__(self) -> None:
        if self.done is None:
            self.program()
            return
        log: list[str] = []
        with recording(self.engine, log):
            self.program()
        self.done(ProgramSignature(False, tuple(log)))
        self.done = None


def compare(device_type: str, a: ProgramSignature | None, b: ProgramSignature | None) -> dict:
    """Verdicts for two arms: captured graphs, and the recorded programs."""
    if a is None or b is None:
        return {"graphs": "not recorded (an arm ran no round)", "programs": "not recorded",
                "programs_differ": None}
    if device_type != "cuda":
        graphs = f"{NO_GRAPHS_ON_DEVICE} ({device_type}): nothing captured to compare"
    elif not (a.captured or b.captured):
        graphs = "graphs off in both arms: nothing captured to compare"
    elif a.captured != b.captured:
        graphs = "only one arm captures a graph: they differ by construction"
    elif a.digest == b.digest:
        graphs = ("IDENTICAL captured launches: a measured difference does not come from the "
                  "round program")
    else:
        graphs = "captured launches differ"
    differ = a.digest != b.digest
    what = "launches recorded during capture" if a.captured and b.captured else \
        "ops-table calls of the first round"
    programs = (f"{what} {'differ' if differ else 'are IDENTICAL'} "
                f"({len(a.calls)} vs {len(b.calls)} calls)")
    return {"graphs": graphs, "programs": programs, "programs_differ": differ}
