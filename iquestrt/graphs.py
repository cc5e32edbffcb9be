"""How a request's rounds are launched (RuntimeConfig.graphs / .loop):

  eager    the round program's kernels launched by the host, once per round
  graph    one CUDA graph of the round, captured per request, launched once per round by the
           host; with an adaptive depth policy its later depths sit in IF nodes
           (iquestrt/cond_graph.py), so a depth the control step skipped runs no kernel
  device   the round inside a WHILE conditional node: one launch runs rounds until the request
           is done or the host's next log read is due

Capture runs the program twice (a warm-up on a side stream that JIT-compiles the kernels, then
the capture) with the state's done flag set: every kernel sees 0 live rows and every state
update is `where(go, …)`, so neither run changes the request's state or caches (iquestrt/round.py).
Graphs bind addresses: the state's, the caches' and the round program's own buffers (drafts,
q rows, the carry across depth parts). A launcher therefore owns its program — a graph outliving
it replays into freed blocks that the allocator hands to the next tensor (on the H200 this made
four alternating engines corrupt each other). A new request of the same shape reuses the
launcher (RoundPrograms.get); another shape captures anew, outside the decode clock like
prefill. The draft depth of the captured program is the policy's maximum; an adaptive policy's
later depths are gated on the device (IF nodes, or 0 live rows when eager).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from iquestrt.capture import graph_capture
from iquestrt.cond_graph import CondGraph
from iquestrt.cond_nodes import ConditionKernel
from iquestrt.round import RoundProgram
from iquestrt.state import DeviceState


class Launcher:
    """launch(first, rounds): queue rounds first … first+rounds−1 (asynchronous on a GPU);
    `first` = rounds committed so far (the host knows it from its last log read). Holds
    `program`: its buffers are the ones a captured graph of it reads and writes."""

    def __init__(self, one_round: Callable[[], None], program: RoundProgram,
                 graph: torch.cuda.CUDAGraph | None = None):
        self.one_round, self.program, self.graph = one_round, program, graph

    def launch(self, first: int, rounds: int) -> None:
        for _ in range(rounds):
            self.one_round()

    def close(self) -> None:
        # NCCL counts every live graph that captured one of its collectives and destroying
        # its communicator waits for that count to reach 0, so graphs are freed explicitly
        if self.graph is not None:
            self.graph.reset()
            self.graph = None


class CondLauncher(Launcher):
    def __init__(self, graph: CondGraph, program: RoundProgram):
        super().__init__(graph.launch_round if not graph.looping else None, program)
        self.graph = graph

    def launch(self, first: int, rounds: int) -> None:
        if not self.graph.looping:
            return super().launch(first, rounds)
        # a live iteration commits one round, so `rounds` iterations always reach the limit
        self.graph.launch(first + rounds, rounds)

    def close(self) -> None:
        self.graph.close()


class RoundPrograms:
    def __init__(self, graphs: bool, loop: str = "host"):
        self.graphs, self.loop = graphs, loop
        self.launcher: Launcher | None = None
        self._cond: ConditionKernel | None = None  # compiled once per engine
        self._state: DeviceState | None = None  # the state the launcher's program reads
        self.built = self.reused = 0  # launchers built (graphs captured) / reused

    def get(self, engine, st: DeviceState, policy, reuse: bool = False) -> Launcher:
        """The launcher of st's round program; reuse: st is the state the current launcher
        was built (and its graphs captured) on, refilled for a new request of the same shape —
        nothing is rebuilt or recaptured."""
        if reuse and self.launcher is not None and self._state is st:
            self.reused += 1
            return self.launcher
        if self.launcher is not None:
            self.launcher.close()
        self._state = st
        self.built += 1
        program = RoundProgram(engine, st, policy)
        if not self.graphs:
            self.launcher = Launcher(program, program)
            return self.launcher
        if st.tokens.device.type != "cuda":
            raise ValueError("RuntimeConfig.graphs needs a CUDA device")
        if self.loop == "device" or program.split:
            if self._cond is None:
                self._cond = ConditionKernel.compile(st.tokens.device)
            graph = capture_conditional(program, st, self._cond, self.loop == "device")
            self.launcher = CondLauncher(graph, program)
            return self.launcher
        graph = capture(program, st)
        self.launcher = Launcher(graph.replay, program, graph)
        return self.launcher

    def close(self) -> None:
        """Free the current launcher's graphs; the next get() builds (captures) anew."""
        if self.launcher is not None:
            self.launcher.close()
        self.launcher, self._state = None, None


def _warm_up(program: RoundProgram) -> None:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        program()
    torch.cuda.current_stream().wait_stream(side)


def capture(program: RoundProgram, st: DeviceState) -> torch.cuda.CUDAGraph:
    done = st.done.clone()
    st.done.fill_(1)
    _warm_up(program)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        program()
    st.done.copy_(done)
    return graph


def capture_conditional(program: RoundProgram, st: DeviceState, cond: ConditionKernel,
                        loop: bool) -> CondGraph:
    done = st.done.clone()
    st.done.fill_(1)
    _warm_up(program)
    pre, parts, post = program.segments()
    graph = CondGraph(pre, parts, post, cond, (st.done, st.round) if loop else None)
    st.done.copy_(done)
    return graph
