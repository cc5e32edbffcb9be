"""The round programs of a request: eager, or CUDA graphs (a family keyed by draft depth, i.e.
by verification width depth + 1), each captured once per request and replayed once per round.

Capture runs the program twice (a warm-up on a side stream that JIT-compiles the kernels, then
the capture) with the state's done flag set: every kernel sees 0 live rows and every state
update is `where(go, …)`, so neither run changes the request's state or caches (iquestrt/round.py).
Graphs bind the addresses of this request's state and caches; a new request captures anew
(outside the decode clock, like prefill).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from iquestrt.round import RoundProgram
from iquestrt.state import DeviceState
from reference.speculative import GenerationRequest


class RoundPrograms:
    def __init__(self, graphs: bool):
        self.graphs = graphs
        self.captured: dict[int, torch.cuda.CUDAGraph] = {}  # depth → graph (current request)

    def get(self, engine, st: DeviceState, req: GenerationRequest, policy
            ) -> Callable[[], None]:
        program = RoundProgram(engine, st, req, policy)
        depth = policy.max_depth
        if not self.graphs:
            return program
        if st.tokens.device.type != "cuda":
            raise ValueError("RuntimeConfig.graphs needs a CUDA device")
        self.captured = {depth: capture(program, st)}
        return self.captured[depth].replay


def capture(program: RoundProgram, st: DeviceState) -> torch.cuda.CUDAGraph:
    done = st.done.clone()
    st.done.fill_(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        program()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        program()
    st.done.copy_(done)
    return graph
