"""Two speed-ups of Triton 3.6's interpreter for the test harness; neither changes a bit of
what a kernel computes. `install()` applies both (tests/conftest.py in the pytest process,
tests/tp/tp_workers.py in the TP tests' spawned ranks, whenever kernels run interpreted).

Repeated patching. The interpreter patches the language modules again on every call of a
@triton.jit device function (InterpretedFunction.__call__ → _patch_lang: a walk over every
member of tl, tl.tensor, tl.math or tl.core, never undone) — a quarter of an interpreted
kernel's time in this suite. Within one launch (GridExecutor.__call__, which patches the modules
its kernel's module sees and undoes that when it returns) a module once patched stays patched
until the launch returns: patching it again finds its builtins replaced already and swaps the
rest for equivalent functions. `skip_repeated_patching()` makes a device function call patch
only when its module sees a language module this launch has not patched yet.

Overflow checks. The interpreter's builder redoes every int32 add, sub and mul in int64 with two
comparisons (`sanitize_overflow`, on by default) and hands the result to device_assert, which
drops it unless the builder's `debug` option is on — it is off, and nothing sets it: work whose
result is never used, a quarter of what is left. `skip_overflow_checks()` turns it off while
`debug` is off (a builder in debug mode keeps its checks).

Other Triton versions keep the interpreter's own behaviour (install() → False).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

VERSION = "3.6.0"  # the InterpretedFunction.__call__ body that `call` below repeats


def install() -> bool:
    """Both speed-ups (once per process) → whether they are installed (this Triton is VERSION)."""
    return skip_repeated_patching() and skip_overflow_checks()


def skip_overflow_checks() -> bool:
    """The interpreter's builder stops computing int32 overflow checks that its device_assert
    would drop (debug off) → installed."""
    import triton
    from triton.runtime import interpreter as ti

    if triton.__version__ != VERSION:
        return False
    b = ti.interpreter_builder
    if b.options.debug:  # its checks raise: keep them
        return False
    b.options = dataclasses.replace(b.options, sanitize_overflow=False)
    return True


def skip_repeated_patching() -> bool:
    """Install the skip (once per process) → whether it is installed."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as ti

    if triton.__version__ != VERSION:
        return False
    if getattr(ti.InterpretedFunction.__call__, "skips_repeated_patching", False):
        return True
    launch_call, device_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__
    langs: dict = {}  # function → ids of the language modules its globals hold
    launches = threading.local()  # .patched: per running launch (innermost last), module ids

    def lang_ids(fn) -> frozenset:
        if fn not in langs:
            langs[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                  if inspect.ismodule(v) and v in (tl, tl.core))
        return langs[fn]

    def launch(self, *args, **kwargs):
        patched = launches.__dict__.setdefault("patched", [])
        patched.append(set(lang_ids(self.fn)))
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def call(self, *args, **kwargs):
        patched, ids = getattr(launches, "patched", None), lang_ids(self.fn)
        if not patched or not ids:  # none in sight: the interpreter's own assertion fails
            return device_call(self, *args, **kwargs)
        if not ids <= patched[-1]:
            ti._patch_lang(self.fn)
            patched[-1] |= ids
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    call.skips_repeated_patching = True
    call.original, launch.original = device_call, launch_call  # what tests compare against
    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = call
    return True
