"""Programmatic dependent launch (PDL) for the production kernels: less fixed cost per launch.

A kernel launched with PDL may be scheduled before the kernel ahead of it on the stream has
finished; only its `griddepcontrol.wait` waits for that kernel to complete and its stores to be
visible. Every kernel here that takes `PDL` therefore calls `pdl_enter` as its first statement,
in every program, before any load or store: nothing is read (a predecessor's output) or written
(a buffer a predecessor still reads) before the predecessor completed, so the stream means what
it means without PDL — and the readiness protocol's "producer(t) → consumer(t) → producer(t + 1)
stream-ordered" assumption (kernels/readiness.py) holds. Every program must reach the wait: a
kernel whose programs all exit without it could complete before its predecessor and release its
successor too early. The one statement allowed before it is an L2 prefetch hint of the kernel's
own weights (`if PREFETCH: prefetch_…`, `prefetch_l2`): it reads nothing into the program and
no predecessor writes the weights (tests/kernels/test_launch.py checks both shapes).

By default no kernel calls `griddepcontrol.launch_dependents`, so a successor is released when
its predecessor's programs have exited (the implicit trigger) rather than when they start. Measured
in the rank round on the H200 (`python -m benchmarks.rank --pdl ab --widths 6 --contexts 1K 64K
--reps 3`; reports/benchmarks/h200-2026-11-30/session7/rank_pdl_trigger_call7.log and
rank_pdl_waitonly_call8.log): with the early trigger at the top of every kernel PDL cost +0.4 %
(1K) and +1.4 % (64K) — the waiting successors' programs hold SM slots the primary still needs —
and without it PDL saved 0.9 % (11.092 → 10.995 ms at 1K, 11.743 → 11.643 ms at 64K). A trigger
pays only after work that does not depend on the predecessor (e.g. weight prefetch before the
wait). That pair is built as switches: the MoE tail releases its successor at its start
(`pdl_enter(PDL, RELEASE)`, TailLaunch.moe_release) — its grid is small and latency-bound, so
the next layer's QKV programs find free SMs — and the FP8 linear prefetches its weight slice
into L2 before its wait (`prefetch_l2`, LinearLaunch.prefetch_w): the weights are no
predecessor's output, so reading them early changes nothing the wait protects. An early
release is always safe for the data: the successor's wait still waits for this kernel to
complete and its stores to be visible. Measured 0.9–1.4 % slower rounds on the H100 with PDL
on (reports/benchmarks/h100-2026-12-07/), so off; PDL itself was 1.1–1.5 % faster there.

Kernels launched without PDL (torch ops between ours) release their successor at completion as
usual, so a PDL kernel after one starts after it.

On a CPU (the Triton interpreter) PDL is refused: `griddepcontrol` is PTX only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr, RELEASE: tl.constexpr = False):
    """First statement of a PDL-capable kernel (see the module docstring). RELEASE: let the next
    launch on the stream start now (its own wait still waits for this kernel to complete)."""
    if PDL:
        if RELEASE:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs, mask, fallback):
    """A cache hint: bring the 128-byte lines at ptrs (where mask; elsewhere the valid address
    fallback) into L2 with evict-last priority. Reads nothing into registers, writes nothing,
    changes no bit; PTX `prefetch.global.L2::evict_last`, so compiled code only (the
    interpreter runs no inline assembly — callers use it only with PDL, which it refuses)."""
    p = tl.where(mask, ptrs, fallback).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                              "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1)


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
