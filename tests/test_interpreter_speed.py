"""The test harness's interpreter speed-ups (tests/helpers/interpreter_speed.py): under Triton
3.6 all three are installed; a launch patches the language modules once instead of once per
device-function call and leaves them as it found them; int32 ops no longer compute overflow
checks that the builder would drop (debug off), while a builder in debug mode still raises on
them; types named, tuple-typed and mapped to numpy on first use equal the eager ones; the
kernels give the interpreter's own bits."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as ti

from tests.helpers import interpreter_speed

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
    # int32 arithmetic (checked for overflow by the interpreter's own builder): the element index
    j = (offs * 7 + 3 - offs * 6 - 3) % n
    tl.store(y_ptr + j, _outer(x, s), mask=offs < n)


@triton.jit
def _overflow_kernel(out_ptr, big):
    tl.store(out_ptr, big * 2)  # int32 × 2 past 2**31 - 1


def _run() -> torch.Tensor:
    x = torch.linspace(-3.0, 3.0, N)  # (N,) fp32
    y = torch.empty_like(x)
    _kernel[(triton.cdiv(N, BLOCK),)](x, y, N, 0.75, BLOCK=BLOCK)
    return y


def _checking_overflow(monkeypatch, debug: bool = False) -> None:
    """The interpreter's own builder options (debug False), or debug mode."""
    b = ti.interpreter_builder
    monkeypatch.setattr(b, "options", dataclasses.replace(b.options, sanitize_overflow=True,
                                                          debug=debug))


def _installed() -> bool:
    return getattr(ti.InterpretedFunction.__call__, "skips_repeated_patching", False)


def test_installed_under_the_triton_it_was_written_for():
    if triton.__version__ != interpreter_speed.VERSION:
        pytest.skip(f"Triton {triton.__version__}: the interpreter's own behaviour is kept")
    assert _installed() and interpreter_speed.install()
    assert ti.interpreter_builder.options.sanitize_overflow is False


@pytest.fixture
def patch_calls(monkeypatch):
    """Counts the interpreter's language patching (launch and device calls alike)."""
    calls, real = [], ti._patch_lang
    monkeypatch.setattr(ti, "_patch_lang", lambda fn: calls.append(fn.__name__) or real(fn))
    return calls


def _eager_types(monkeypatch) -> None:
    """The interpreter's own type constructors and dtype table (their instance attributes win
    over the deferred class attributes)."""
    core = tl.core
    for cls in (core.block_type, core.tuple_type, core.tuple):
        monkeypatch.setattr(cls, "__init__", cls.__init__.original)
    monkeypatch.setattr(ti, "_get_np_dtype", ti._get_np_dtype.original)


def test_a_launch_patches_once_and_gives_the_interpreters_bits(monkeypatch, patch_calls):
    if not _installed():
        pytest.skip("not installed for this Triton")
    fast = _run()
    assert patch_calls == ["_kernel"], patch_calls  # 3 programs × 2 device calls skipped
    del patch_calls[:]
    monkeypatch.setattr(ti.InterpretedFunction, "__call__",
                        ti.InterpretedFunction.__call__.original)
    monkeypatch.setattr(ti.GridExecutor, "__call__", ti.GridExecutor.__call__.original)
    _checking_overflow(monkeypatch)
    _eager_types(monkeypatch)
    assert "name" in vars(tl.core.block_type(tl.float32, [4]))  # eager again
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


def test_the_skipped_overflow_checks_are_the_ones_dropped_outside_debug_mode(monkeypatch):
    if not _installed():
        pytest.skip("not installed for this Triton")
    assert ti.interpreter_builder.options.debug is False
    out = torch.zeros(1, dtype=torch.int32)
    _overflow_kernel[(1,)](out, 2**30 + 5)
    assert out.item() == -(2**31) + 10  # wrapped, as a compiled kernel's int32 does
    _checking_overflow(monkeypatch)  # the interpreter's own options: checked, then dropped
    out.zero_()
    _overflow_kernel[(1,)](out, 2**30 + 5)
    assert out.item() == -(2**31) + 10
    _checking_overflow(monkeypatch, debug=True)  # the same check, kept: it raises
    with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
        _overflow_kernel[(1,)](out, 2**30 + 5)
    assert not interpreter_speed.skip_overflow_checks()  # debug mode keeps its checks
    assert ti.interpreter_builder.options.sanitize_overflow is True


def _types():
    """Block, tuple and pointer types as kernels build them: int, constexpr and tl.tuple shapes,
    named tuples, a tuple holding a tuple."""
    core = tl.core
    blocks = [core.block_type(tl.float32, [16, 32]), core.block_type(tl.bfloat16, [8]),
              core.block_type(tl.int1, [tl.constexpr(4), 2]),
              core.block_type(tl.pointer_type(tl.float8e4nv), core.tuple([2, 64]))]
    shape = core.tuple([tl.constexpr(16), tl.constexpr(32)])
    tuples = [shape, core.tuple([tl.constexpr(3), tl.float16]), core.tuple([shape, 7]),
              core.tuple([1, 2], core.tuple_type([core.constexpr_type(1),
                                                  core.constexpr_type(2)], ["a", "b"]))]
    return blocks, tuples


def _described(blocks, tuples) -> list:
    return ([(b.name, str(b), b.numel, list(b.shape), type(b.shape)) for b in blocks]
            + [(t.type.name, str(t.type), t.type.fields, [str(x) for x in t.type.types])
               for t in tuples])


def test_deferred_types_equal_the_eager_ones(monkeypatch):
    if not getattr(tl.core.block_type.__init__, "defers_names", False):
        pytest.skip("not installed for this Triton")
    core = tl.core
    fresh = core.block_type(tl.float32, [16, 32]), core.tuple([tl.constexpr(2)])
    assert "name" not in vars(fresh[0]) and "type" not in vars(fresh[1])  # deferred
    assert "name" not in vars(fresh[1].type)
    assert "type" in vars(core.tuple([fresh[1], 7]))  # holds a tuple: typed at once
    blocks, tuples = _types()
    fast = _described(blocks, tuples)
    with pytest.raises(TypeError, match="0d block_type is forbidden"):
        tl.core.block_type(tl.float32, [])
    with pytest.raises(ValueError, match="power of 2"):
        tl.core.block_type(tl.float32, [3])
    _eager_types(monkeypatch)
    eager_blocks, eager_tuples = _types()
    assert "name" in vars(eager_blocks[0]) and "type" in vars(eager_tuples[0])
    assert fast == _described(eager_blocks, eager_tuples)
    assert blocks == eager_blocks and [t.type for t in tuples] == [t.type for t in eager_tuples]
    for t, e in zip(tuples, eager_tuples, strict=True):  # item assignment retypes both alike
        t._setitem(0, tl.constexpr(5)), e._setitem(0, tl.constexpr(5))
        assert t.type.name == e.type.name


def test_the_dtype_table_built_once_maps_as_the_interpreters(monkeypatch):
    if not getattr(tl.core.block_type.__init__, "defers_names", False):
        pytest.skip("not installed for this Triton")
    fast, own = ti._get_np_dtype, ti._get_np_dtype.original
    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
               tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5,
               tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15]
    kinds = scalars + [tl.pointer_type(tl.float32)] + [
        tl.core.block_type(t, [4]) for t in scalars + [tl.pointer_type(tl.int8)]]
    assert [fast(t) for t in kinds] == [own(t) for t in kinds]
    assert {str(own(t)) for t in scalars} >= {"bool", "uint8", "uint16", "float32"}
