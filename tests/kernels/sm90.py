"""Compile kernels for sm_90 without a GPU: run a script in a fresh interpreter (no
TRITON_INTERPRET, so @triton.jit builds real kernels) that prints one JSON line of facts about
the PTX / ptxas output; the caller asserts on them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compile_sm90(script: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"sm_90 compile failed:\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def fusion_off_on(script: str) -> tuple[dict, dict]:
    """For scripts printing {"False": counts, "True": counts} (enable_fp_fusion off / on):
    → (off, on); skips when this Triton has no NVIDIA backend."""
    import pytest

    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its NVIDIA backend")
    got = compile_sm90(script)
    return got["False"], got["True"]


_FUSION_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import {module}

fn = {module}.{kernel}
sig, const, patterns = {sig!r}, {const!r}, {patterns!r}
res = {{}}
for fusion in (False, True):
    full = {{a: "constexpr" if a in const else sig.get(a, "i32") for a in fn.arg_names}}
    k = triton.compile(ASTSource(fn, full, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps={warps}, enable_fp_fusion=fusion))
    ptx = k.asm["ptx"]
    res[str(fusion)] = {{t: len(re.findall(t, ptx)) for t in patterns}}
print(json.dumps(res))
"""


def fusion_counts(module: str, kernel: str, sig: dict, const: dict, patterns: tuple[str, ...],
                  warps: int = 4) -> tuple[dict, dict]:
    """kernels.<module>.<kernel> compiled for sm_90 with enable_fp_fusion off and on (arguments
    not in sig are i32, those in const constexpr) → (off, on): counts of each PTX regex."""
    return fusion_off_on(_FUSION_SCRIPT.format(module=module, kernel=kernel, sig=sig,
                                               const=const, patterns=patterns, warps=warps))


def loop_facts(ttgir: str) -> tuple[int, int]:
    """A compiled kernel's TTGIR → (synchronous loads inside its loop bodies — between an
    scf.for and its scf.yield —, the most cp.async groups a loop's wait leaves in flight).
    In flight 0: each iteration's tiles are issued after the previous iteration's MMAs and all
    waited for before its own (no overlap of loads with compute); 2 per tile operand pair and
    stage beyond the second with Triton 3.6's pipeliner."""
    inside, loads, in_flight = False, 0, 0
    for line in ttgir.splitlines():
        inside = (inside or "scf.for" in line) and "scf.yield" not in line
        loads += inside and " tt.load " in line
        wait = re.search(r"ttg.async_wait .*num = (\d+)", line) if inside else None
        in_flight = max(in_flight, int(wait.group(1)) if wait else 0)
    return loads, in_flight
