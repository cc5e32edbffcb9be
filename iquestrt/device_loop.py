"""The request loop on the device (issue 4, "graphs"): one CUDA graph whose WHILE conditional
node replays the captured round until the request is done or a round limit is reached, so the
host launches once per log read instead of once per round.

PyTorch cannot capture conditional nodes (PLATFORM.md); the CUDA driver API (cuda-python) builds
them. The round itself is an ordinary PyTorch capture (its memory pool stays PyTorch's), kept
as a raw graph and cloned into the WHILE body as a child graph. The condition is set on the
device by a one-thread kernel calling cudaGraphSetConditional — a CUDA runtime builtin: declared
below, it compiles with NVRTC without the device-runtime headers.

  outer graph   WHILE(h)   h = 1 at every launch (CU_GRAPH_COND_ASSIGN_DEFAULT)
    body        child graph { round program ; keep_going(h, done, round, ctrl) }
  keep_going    ctrl[1] += 1;  h = done == 0  &&  round < ctrl[0]  &&  ctrl[1] < ctrl[2]
  ctrl [3] i32  limit: stop once this many rounds are committed (the host's next log read);
                iterations so far; max_iters: a bound that ends the loop even if a bug kept
                done and round from advancing

A launch whose request is already done runs the body once with done = 1, which commits nothing
(iquestrt/round.py). The host loop launches up to sync_rounds − 1 such rounds after the end;
the device loop stops at once. Both commit the same rounds with the same bits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

COND_NAME = b"iq_keep_going"
COND_SOURCE = rb"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

extern "C" __global__ void iq_keep_going(cudaGraphConditionalHandle handle, const int* done,
                                         const int* round, int* ctrl) {
    int it = ctrl[1] + 1;
    ctrl[1] = it;
    unsigned int go = done[0] == 0 && round[0] < ctrl[0] && it < ctrl[2];
    cudaGraphSetConditional(handle, go);
}
"""


class DeviceLoopError(RuntimeError):
    """A CUDA driver/NVRTC call of the device loop failed; the message names the call."""


class DeviceTimeout(RuntimeError):
    """The device did not finish the launched rounds within RuntimeConfig.wait_s."""


def wait_bounded(stream: torch.cuda.Stream, timeout_s: float, what: str) -> None:
    """Block until the work queued on `stream` so far is done, or raise DeviceTimeout after
    timeout_s (the device may still be running then; the request is failed, not hung)."""
    ev = torch.cuda.Event()
    ev.record(stream)
    deadline = time.perf_counter() + timeout_s
    pause = 20e-6
    while not ev.query():
        if time.perf_counter() > deadline:
            raise DeviceTimeout(f"{what}: the device did not finish within {timeout_s} s "
                                "(RuntimeConfig.wait_s)")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _ok(result, call: str):
    """cuda-python returns (error, *values): raise on an error, else the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise DeviceLoopError(f"{call} failed: {err!r}")
    return values[0] if len(values) == 1 else tuple(values)


@dataclass
class ConditionKernel:
    """keep_going, compiled once per process context (NVRTC → PTX → module)."""

    module: object
    function: object
    ctx: object

    @classmethod
    def compile(cls, device: torch.device) -> ConditionKernel:
        from cuda.bindings import driver, nvrtc

        torch.cuda.init()
        torch.empty(1, device=device)  # makes PyTorch's primary context current
        major, minor = torch.cuda.get_device_capability(device)
        prog = _ok(nvrtc.nvrtcCreateProgram(COND_SOURCE, b"keep_going.cu", 0, [], []),
                   "nvrtcCreateProgram")
        opts = [f"--gpu-architecture=compute_{major}{minor}".encode()]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(res[0]) != 0:
            size = _ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise DeviceLoopError(f"NVRTC could not compile keep_going: {log.decode()}")
        size = _ok(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = b" " * size
        _ok(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        nvrtc.nvrtcDestroyProgram(prog)
        image = np.frombuffer(ptx, dtype=np.uint8).copy()
        module = _ok(driver.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData")
        function = _ok(driver.cuModuleGetFunction(module, COND_NAME), "cuModuleGetFunction")
        ctx = _ok(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        return cls(module, function, ctx)

    def launch(self, handle: int, done: torch.Tensor, rnd: torch.Tensor, ctrl: torch.Tensor
               ) -> None:
        """On the current stream (captured when it is capturing)."""
        from cuda.bindings import driver

        values = [np.array([int(handle)], dtype=np.uint64)] + [
            np.array([t.data_ptr()], dtype=np.uint64) for t in (done, rnd, ctrl)]
        args = np.array([v.ctypes.data for v in values], dtype=np.uint64)
        stream = torch.cuda.current_stream().cuda_stream
        _ok(driver.cuLaunchKernel(self.function, 1, 1, 1, 1, 1, 1, 0, stream,
                                  args.ctypes.data, 0), "cuLaunchKernel(keep_going)")


def _add_conditional(driver, graph, params):
    """cuGraphAddNode: CUDA 13 bindings take edge data (graph, deps, edges, n, params);
    CUDA 12's take (graph, deps, n, params)."""
    try:
        return _ok(driver.cuGraphAddNode(graph, None, None, 0, params), "cuGraphAddNode")
    except TypeError:
        return _ok(driver.cuGraphAddNode(graph, None, 0, params), "cuGraphAddNode")


class DeviceLoop:
    """Callable launch(limit): rounds run on the device until `limit` rounds are committed,
    the request is done, or max_iters iterations ran. Asynchronous, like a graph replay."""

    def __init__(self, program: Callable[[], None], done: torch.Tensor, rnd: torch.Tensor,
                 cond: ConditionKernel):
        from cuda.bindings import driver

        self._driver, self.cond = driver, cond
        dev = done.device
        self.ctrl = torch.zeros(3, dtype=torch.int32, device=dev)
        self.graph = _ok(driver.cuGraphCreate(0), "cuGraphCreate")
        self.handle = _ok(driver.cuGraphConditionalHandleCreate(self.graph, cond.ctx, 1, 1),
                          "cuGraphConditionalHandleCreate")
        # the body: the round and keep_going in one PyTorch capture (its pool, its allocator)
        self.body_capture = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(self.body_capture):
            program()
            cond.launch(int(self.handle), done, rnd, self.ctrl)
        raw = driver.CUgraph(self.body_capture.raw_cuda_graph())
        params = driver.CUgraphNodeParams()
        params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = self.handle
        params.conditional.type = driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
        params.conditional.size = 1
        params.conditional.ctx = cond.ctx
        _add_conditional(driver, self.graph, params)
        body = params.conditional.phGraph_out[0]
        _ok(driver.cuGraphAddChildGraphNode(body, None, 0, raw), "cuGraphAddChildGraphNode")
        self.exec = _ok(driver.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")

    def launch(self, limit: int, max_iters: int) -> None:
        # pageable source: the copy completes before the host goes on (no buffer reuse race)
        self.ctrl.copy_(torch.tensor([limit, 0, max_iters], dtype=torch.int32))
        stream = torch.cuda.current_stream().cuda_stream
        _ok(self._driver.cuGraphLaunch(self.exec, stream), "cuGraphLaunch")

    def close(self) -> None:
        """Free the instantiated and built graphs (the body capture's pool goes with it)."""
        d = self._driver
        if getattr(self, "exec", None) is not None:
            d.cuGraphExecDestroy(self.exec)
            self.exec = None
        if getattr(self, "graph", None) is not None:
            d.cuGraphDestroy(self.graph)
            self.graph = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
