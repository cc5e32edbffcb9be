"""A round (or the whole request loop) as one CUDA graph with conditional nodes, assembled with
the driver API from PyTorch captures of the round's parts (RoundProgram.segments):

  top ─ [WHILE h_w  (device loop only; h_w = 1 at every launch)] ─ T
  T:      pre ──▶ IF(h_a) ─────────────────────────────────────────▶ post [; keep_going(h_w)]
                   └ body: part a ──▶ IF(h_b) ─ body: part b ──▶ IF(h_c) …
  pre ends with set_if(h_a, flag): flag = "run depth a" from the control step; part k ends with
  set_if(h_next, its flag). A nested IF runs only inside its parent, so a depth whose control
  said stop executes no kernel, and neither does any later one.

Each part is captured by PyTorch into its own graph (keep_graph=True), all sharing one memory
pool: tensors one part hands to the next stay referenced, and the parts always run in capture
order (a skipped part's scratch is nobody else's input). The driver clones each capture into a
child-graph node; the PyTorch graphs are kept alive for their pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from iquestrt.capture import graph_capture
from iquestrt.cond_nodes import ConditionKernel, add_conditional, checked, new_handle

Part = Callable[[], "torch.Tensor | None"]  # returns the [1] int32 flag "run the next part"


class CondGraph:
    """launch_round(): one round (host loop). With `loop_state` = (done, round) tensors it is
    the device loop instead: launch(limit, max_iters) runs rounds until `limit` rounds are
    committed, done, or max_iters iterations."""

    def __init__(self, pre: Part, parts: list[tuple[int, Part]], post: Callable[[], None],
                 cond: ConditionKernel,
                 loop_state: tuple[torch.Tensor, torch.Tensor] | None = None):
        from cuda.bindings import driver

        self._driver, self.cond, ctx = driver, cond, cond.ctx
        self.looping = loop_state is not None
        dev = torch.cuda.current_device()
        self.ctrl = torch.zeros(3, dtype=torch.int32, device=dev)
        self._captures: list[torch.cuda.CUDAGraph] = []
        self.graph = checked(driver.cuGraphCreate(0), "cuGraphCreate")
        self.exec = None
        body = self.graph
        if self.looping:
            h_w = new_handle(self.graph, ctx, 1, reset_each_launch=True)
            _, body = add_conditional(self.graph, [], h_w, "while", ctx)
        h = new_handle(body, ctx, 0, reset_each_launch=False) if parts else None
        n_pre = self._child(body, [], lambda: self._then(pre(), h))
        after_pre, parent, deps = [n_pre], body, [n_pre]
        for i, (_, part) in enumerate(parts):
            node, inner = add_conditional(parent, deps, h, "if", ctx)
            if i == 0:
                after_pre = [node]
            h = new_handle(inner, ctx, 0, reset_each_launch=False) if i + 1 < len(parts) else None
            n = self._child(inner, [], lambda part=part, h=h: self._then(part(), h))
            parent, deps = inner, [n]

        def last() -> None:
            post()
            if self.looping:
                cond.keep_going(h_w, *loop_state, self.ctrl)

        self._child(body, after_pre, last)
        self.exec = checked(driver.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")
        self.if_nodes = len(parts)

    def _then(self, flag: torch.Tensor | None, handle) -> None:
        if handle is not None:
            self.cond.set_if(handle, flag)

    def _child(self, graph, deps: list, fn: Callable[[], None]):
        """Capture fn with PyTorch (the shared pool) and add it to `graph` after deps."""
        g = torch.cuda.CUDAGraph(keep_graph=True)
        pool = self._captures[0].pool() if self._captures else None
        with graph_capture(g, pool=pool):
            fn()
        self._captures.append(g)
        raw = self._driver.CUgraph(g.raw_cuda_graph())
        return checked(self._driver.cuGraphAddChildGraphNode(graph, deps or None, len(deps), raw),
                   "cuGraphAddChildGraphNode")

    def launch_round(self) -> None:
        if self.looping:
            raise RuntimeError("CondGraph: a device loop is launched with launch(limit, …)")
        self._launch()

    def launch(self, limit: int, max_iters: int) -> None:
        if not self.looping:
            raise RuntimeError("CondGraph: one round per launch_round(); no loop was built")
        # pageable source: the copy completes before the host goes on (no buffer reuse race)
        self.ctrl.copy_(torch.tensor([limit, 0, max_iters], dtype=torch.int32))
        self._launch()

    def _launch(self) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        checked(self._driver.cuGraphLaunch(self.exec, stream), "cuGraphLaunch")

    def close(self) -> None:
        """Free the instantiated and built graphs and the captured parts (their pool goes with
        them). Explicit calls only: a part's reset during another stream's capture invalidates
        that capture (on the H200 garbage collection ran it inside a capture:
        reports/benchmarks/h200-2026-11-30/session8/graphs_gpu_call6_failed.log)."""
        self._destroy()
        for g in getattr(self, "_captures", ()):
            g.reset()
        self._captures = []

    def _destroy(self) -> None:
        d = self._driver
        if getattr(self, "exec", None) is not None:
            d.cuGraphExecDestroy(self.exec)
            self.exec = None
        if getattr(self, "graph", None) is not None:
            d.cuGraphDestroy(self.graph)
            self.graph = None

    def __del__(self):
        try:
            self._destroy()
        except Exception:
            pass
