"""Programmatic dependent launch (PDL) for the production kernels: less fixed cost per launch.

A kernel launched with PDL may be scheduled before the kernel ahead of it on the stream has
finished; only its `griddepcontrol.wait` waits for that kernel to complete and its stores to be
visible. Every kernel here that takes `PDL` therefore calls `pdl_enter` as its first statement,
in every program, before any load or store: nothing is read (a predecessor's output) or written
(a buffer a predecessor still reads) before the predecessor completed, so the stream means what
it means without PDL — and the readiness protocol's "producer(t) → consumer(t) → producer(t + 1)
stream-ordered" assumption (kernels/readiness.py) holds. Every program must reach the wait: a
kernel whose programs all exit without it could complete before its predecessor and release its
successor too early.

No kernel calls `griddepcontrol.launch_dependents`, so a successor is released when its
predecessor's programs have exited (the implicit trigger) rather than when they start. Measured
in the rank round on the H200 (`python -m benchmarks.rank --pdl ab --widths 6 --contexts 1K 64K
--reps 3`; reports/benchmarks/h200-2026-11-30/session7/rank_pdl_trigger_call7.log and
rank_pdl_waitonly_call8.log): with the early trigger at the top of every kernel PDL cost +0.4 %
(1K) and +1.4 % (64K) — the waiting successors' programs hold SM slots the primary still needs —
and without it PDL saved 0.9 % (11.092 → 10.995 ms at 1K, 11.743 → 11.643 ms at 64K). A trigger
pays only after work that does not depend on the predecessor (e.g. weight prefetch before the
wait), which no kernel here does.

Kernels launched without PDL (torch ops between ours) release their successor at completion as
usual, so a PDL kernel after one starts after it.

On a CPU (the Triton interpreter) PDL is refused: `griddepcontrol` is PTX only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a PDL-capable kernel (see the module docstring)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


def launch_opts(pdl: bool, **compile_opts) -> dict:
    """Keyword arguments for a kernel launch: the kernel's PDL constexpr, and with PDL Triton's
    `launch_pdl` option (a launch attribute, part of the compiled kernel's key); plus the
    kernel's own compile options (e.g. enable_fp_fusion=False)."""
    out = dict(compile_opts, PDL=bool(pdl))
    if pdl:
        out["launch_pdl"] = True
    return out


def check_pdl(pdl: bool, device: torch.device | str) -> None:
    """PDL needs compiled kernels on a CUDA device of compute capability ≥ 9.0 (sm_90)."""
    if not pdl:
        return
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"pdl: programmatic dependent launch needs a CUDA device, got {dev}")
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 9:
        raise ValueError(f"pdl: needs compute capability >= 9.0 (Hopper), "
                         f"{torch.cuda.get_device_name(dev)} is {major}.{minor}")
