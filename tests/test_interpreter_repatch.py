"""The test harness's interpreter speed-up (tests/helpers/interpreter_repatch.py): under Triton
3.6 it is installed, it patches the language modules once per launch instead of once per
device-function call, the kernels it runs give the interpreter's own bits, and a launch leaves
the language modules as it found them."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as ti

from tests.helpers import interpreter_repatch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the speed-up concerns the interpreter only")
N, BLOCK = 96, 32  # 3 programs, each calling 2 device functions (one nested in the other)


@triton.jit
def _inner(x, s):
    return tl.exp(x) * s


@triton.jit
def _outer(x, s):
    y = _inner(x, s) + tl.sqrt(tl.abs(x))
    return tl.where(x > 0, y, -y)


@triton.jit
def _kernel(x_ptr, y_ptr, n, s, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, _outer(x, s), mask=offs < n)


def _run() -> torch.Tensor:
    x = torch.linspace(-3.0, 3.0, N)  # (N,) fp32
    y = torch.empty_like(x)
    _kernel[(triton.cdiv(N, BLOCK),)](x, y, N, 0.75, BLOCK=BLOCK)
    return y


def _installed() -> bool:
    return getattr(ti.InterpretedFunction.__call__, "skips_repeated_patching", False)


def test_installed_under_the_triton_it_was_written_for():
    if triton.__version__ != interpreter_repatch.VERSION:
        pytest.skip(f"Triton {triton.__version__}: the interpreter's own behaviour is kept")
    assert _installed() and interpreter_repatch.skip_repeated_patching()


@pytest.fixture
def patch_calls(monkeypatch):
    """Counts the interpreter's language patching (launch and device calls alike)."""
    calls, real = [], ti._patch_lang
    monkeypatch.setattr(ti, "_patch_lang", lambda fn: calls.append(fn.__name__) or real(fn))
    return calls


def test_a_launch_patches_once_and_gives_the_interpreters_bits(monkeypatch, patch_calls):
    if not _installed():
        pytest.skip("not installed for this Triton")
    fast = _run()
    assert patch_calls == ["_kernel"], patch_calls  # 3 programs × 2 device calls skipped
    del patch_calls[:]
    monkeypatch.setattr(ti.InterpretedFunction, "__call__",
                        ti.InterpretedFunction.__call__.original)
    monkeypatch.setattr(ti.GridExecutor, "__call__", ti.GridExecutor.__call__.original)
    own = _run()
    assert len(patch_calls) == 1 + 3 * 2, patch_calls
    assert torch.equal(fast, own)
    ref = torch.linspace(-3.0, 3.0, N)
    want = torch.where(ref > 0, 1, -1) * (torch.exp(ref) * 0.75 + ref.abs().sqrt())
    torch.testing.assert_close(fast, want, rtol=1e-6, atol=1e-6)  # fp32 exp/sqrt rounding


def test_a_launch_leaves_the_language_modules_as_it_found_them():
    if not _installed():
        pytest.skip("not installed for this Triton")
    names = ("exp", "where", "arange", "load", "range", "static_range")
    before = {n: getattr(tl, n) for n in names}
    add = tl.core.tensor.__add__
    _run()
    assert {n: getattr(tl, n) for n in names} == before
    assert tl.core.tensor.__add__ is add
