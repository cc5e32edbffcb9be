"""CUDA plumbing for conditional graphs (iquestrt/cond_graph.py): the two one-thread condition
kernels, cuda-python driver calls, and the host's bounded wait for launched work.

PyTorch cannot capture conditional (IF / WHILE) nodes; the CUDA driver API (cuda-python) builds
them. A condition is set on the device by a kernel calling cudaGraphSetConditional — a CUDA
runtime builtin: declared below, it compiles with NVRTC without the device-runtime headers.

  keep_going(h, done, round, ctrl)   the WHILE node of the device loop:
      ctrl[1] += 1;  h = done == 0  &&  round < ctrl[0]  &&  ctrl[1] < ctrl[2]
      ctrl [3] i32: limit (stop once this many rounds are committed: the host's next log read),
      iterations so far, max_iters (ends the loop even if a bug kept done and round still)
  set_if(h, flag)                    an IF node (a later draft depth): h = flag[0] != 0
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from iquestrt.errors import RuntimeFault

SPIN_S = 0.05  # wait_bounded spins (no sleep) this long before backing off

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

extern "C" __global__ void iq_set_if(cudaGraphConditionalHandle handle, const int* flag) {
    cudaGraphSetConditional(handle, flag[0] != 0 ? 1u : 0u);
}
"""


class DeviceLoopError(RuntimeFault):
    """A CUDA driver/NVRTC call of the device loop failed; the message names the call."""


class DeviceTimeout(RuntimeError):
    """The device did not finish the launched rounds within RuntimeConfig.wait_s."""


def wait_bounded(stream: torch.cuda.Stream, timeout_s: float, what: str) -> None:
    """Block until the work queued on `stream` so far is done, or raise DeviceTimeout after
    timeout_s (the device may still be running then; the request is failed, not hung)."""
    ev = torch.cuda.Event()
    ev.record(stream)
    start = time.perf_counter()
    deadline = start + timeout_s
    pause = 0.0
    while not ev.query():
        now = time.perf_counter()
        if now > deadline:
            raise DeviceTimeout(f"{what}: the device did not finish within {timeout_s} s "
                                "(RuntimeConfig.wait_s)")
        # spin while a wait is short (a log read every few rounds: a sleep's granularity, up
        # to ~1 ms, would show in the round time); back off to 1 ms sleeps after SPIN_S
        if now - start > SPIN_S:
            pause = min(max(pause * 2, 20e-6), 1e-3)
            time.sleep(pause)


def checked(result, call: str):
    """cuda-python returns (error, *values): raise on an error, else the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise DeviceLoopError(f"{call} failed: {err!r}")
    return values[0] if len(values) == 1 else tuple(values)


@dataclass
class ConditionKernel:
    """keep_going and set_if, compiled once per engine (NVRTC → PTX → module)."""

    module: object
    keep_going_fn: object
    set_if_fn: object
    ctx: object

    @classmethod
    def compile(cls, device: torch.device) -> ConditionKernel:
        from cuda.bindings import driver, nvrtc

        torch.cuda.init()
        torch.empty(1, device=device)  # makes PyTorch's primary context current
        major, minor = torch.cuda.get_device_capability(device)
        prog = checked(nvrtc.nvrtcCreateProgram(COND_SOURCE, b"keep_going.cu", 0, [], []),
                   "nvrtcCreateProgram")
        opts = [f"--gpu-architecture=compute_{major}{minor}".encode()]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(res[0]) != 0:
            size = checked(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise DeviceLoopError(f"NVRTC could not compile keep_going: {log.decode()}")
        size = checked(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = b" " * size
        checked(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        nvrtc.nvrtcDestroyProgram(prog)
        image = np.frombuffer(ptx, dtype=np.uint8).copy()
        module = checked(driver.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData")
        fns = [checked(driver.cuModuleGetFunction(module, name), f"cuModuleGetFunction({name})")
               for name in (b"iq_keep_going", b"iq_set_if")]
        ctx = checked(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        return cls(module, fns[0], fns[1], ctx)

    def keep_going(self, handle, done: torch.Tensor, rnd: torch.Tensor, ctrl: torch.Tensor
                   ) -> None:
        _launch(self.keep_going_fn, "keep_going", handle, done, rnd, ctrl)

    def set_if(self, handle, flag: torch.Tensor) -> None:
        if flag.dtype != torch.int32 or flag.numel() != 1:
            raise ValueError(f"set_if: flag must be one int32, got {flag.dtype} "
                             f"{tuple(flag.shape)}")
        _launch(self.set_if_fn, "set_if", handle, flag)


def _launch(fn, name: str, handle, *tensors: torch.Tensor) -> None:
    """One thread, on the current stream (captured when it is capturing)."""
    from cuda.bindings import driver

    values = [np.array([int(handle)], dtype=np.uint64)] + [
        np.array([t.data_ptr()], dtype=np.uint64) for t in tensors]
    args = np.array([v.ctypes.data for v in values], dtype=np.uint64)
    stream = torch.cuda.current_stream().cuda_stream
    checked(driver.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, args.ctypes.data, 0),
        f"cuLaunchKernel({name})")


def add_conditional(graph, deps: list, handle, kind: str, ctx):
    """A WHILE or IF node in `graph` after `deps` → (node, its body graph)."""
    from cuda.bindings import driver

    params = driver.CUgraphNodeParams()
    params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.handle = handle
    params.conditional.type = {
        "while": driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE,
        "if": driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF,
    }[kind]
    params.conditional.size = 1
    params.conditional.ctx = ctx
    try:  # CUDA 13 bindings take edge data: (graph, deps, edges, n, params)
        node = checked(driver.cuGraphAddNode(graph, deps or None, None, len(deps), params),
                   "cuGraphAddNode")
    except TypeError:  # CUDA 12: (graph, deps, n, params)
        node = checked(driver.cuGraphAddNode(graph, deps or None, len(deps), params),
                   "cuGraphAddNode")
    return node, params.conditional.phGraph_out[0]


def new_handle(graph, ctx, default: int, reset_each_launch: bool):
    from cuda.bindings import driver

    return checked(driver.cuGraphConditionalHandleCreate(graph, ctx, default,
                                                     1 if reset_each_launch else 0),
               "cuGraphConditionalHandleCreate")
