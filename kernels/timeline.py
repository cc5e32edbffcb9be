"""Per-program timestamps inside a kernel, for latency experiments on the GPU.

A kernel built with TRACE on stores the GPU's global timer (`%globaltimer`, ns) at fixed points
of each program into trace[pid, slot] and its SM id into trace[pid, SM_SLOT]; with TRACE off
every stamp compiles away, so the production kernel is unchanged. The points are the kernel's
own (kernels/tails.py names them per program kind); a slot never reached stays 0.

A stamp is taken when the thread that stores it reaches that statement: after the loads whose
values the statements before it consumed, not necessarily after earlier stores became visible.
The global timer advances in steps of tens of ns on Hopper, so differences below ≈ 0.1 µs are
not resolved. PTX only: the Triton interpreter cannot read the timer, so tracing is refused on
a CPU.

Dimension letters: P programs of the traced launch, S slots (SLOTS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SLOTS = 12
SM_SLOT = SLOTS - 1  # the SM the program ran on (not a time)


@triton.jit
def stamp(trace_ptr, pid, slot: tl.constexpr, ON: tl.constexpr):
    """trace[pid, slot] = the global timer now (ns), when ON."""
    if ON:  # 12 = SLOTS (a jit function reads no Python globals)
        tl.store(trace_ptr + pid * 12 + slot, tl.extra.cuda.globaltimer())


@triton.jit
def stamp_at(trace_ptr, pid, slot, ON: tl.constexpr):
    """trace[pid, slot] = the global timer now (ns), when ON, for a slot known only at run time
    (a loop's step); the caller keeps it below SM_SLOT."""
    if ON:
        tl.store(trace_ptr + pid * 12 + slot, tl.extra.cuda.globaltimer())


@triton.jit
def stamp_start(trace_ptr, pid, ON: tl.constexpr):
    """Slot 0 = the program's first statement's time, slot 11 (SM_SLOT) = its SM id, when ON."""
    if ON:
        tl.store(trace_ptr + pid * 12, tl.extra.cuda.globaltimer())
        tl.store(trace_ptr + pid * 12 + 11, tl.extra.cuda.smid().to(tl.int64))


def new_trace(programs: int, device) -> torch.Tensor:
    """A zeroed trace [P, SLOTS] int64 for a launch of `programs` programs on a CUDA device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"trace: kernel timestamps need a CUDA device (PTX %globaltimer), "
                         f"got {dev}")
    if programs < 1:
        raise ValueError(f"trace: expected at least 1 program, got {programs}")
    return torch.zeros(programs, SLOTS, dtype=torch.int64, device=dev)


def check_trace(trace, programs: int, device) -> None:
    """A trace argument must be new_trace(programs, device)'s shape, dtype and device."""
    if not isinstance(trace, torch.Tensor):
        raise ValueError(f"trace: expected a tensor [{programs}, {SLOTS}] int64, got "
                         f"{type(trace).__name__}")
    dev = torch.device(device)
    if dev.type != "cuda" or trace.device != dev:
        raise ValueError(f"trace: kernel timestamps need the launch's CUDA device, got the "
                         f"launch on {dev} and the trace on {trace.device}")
    if (tuple(trace.shape) != (programs, SLOTS) or trace.dtype != torch.int64
            or not trace.is_contiguous()):
        raise ValueError(f"trace: expected a contiguous int64 [{programs}, {SLOTS}] for this "
                         f"launch, got {trace.dtype} {tuple(trace.shape)}")
