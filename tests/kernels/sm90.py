"""Compile kernels for sm_90 without a GPU: run a script in a fresh interpreter (no
TRITON_INTERPRET, so @triton.jit builds real kernels) that prints one JSON line of facts about
the PTX / ptxas output; the caller asserts on them."""

from __future__ import annotations

import json
import os
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
