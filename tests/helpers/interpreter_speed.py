"""Three speed-ups of Triton 3.6's interpreter for the test harness; none changes a bit of
what a kernel computes. `install()` applies all three (tests/conftest.py in the pytest process,
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

Type bookkeeping. Every interpreted op builds Python type objects for its result: a block_type
(whose constructor formats a name string such as "<(16, 32), fp32>"), a tl.tuple of the
tensor's shape (whose constructor builds a tuple_type, formatting one more name from every
field's repr) and, per load/store/splat, a 19-entry dtype table rebuilt on each call
(`_get_np_dtype`). The names are read only to print, compare or hash a type, a fraction of the
ops; `defer_type_bookkeeping()` formats each name on first read (cached, the same string), gives
a tl.tuple of values its tuple_type on first read (a tuple holding another tuple keeps the eager
type: the inner one can change under __setitem__), unwraps an all-int block shape without the
generic walk (the same list) and builds the dtype table once — a sixth of what is left.

Other Triton versions keep the interpreter's own behaviour (install() → False).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

VERSION = "3.6.0"  # the InterpretedFunction.__call__ body that `call` below repeats


def install() -> bool:
    """All three speed-ups (once per process) → whether they are installed (this Triton is
    VERSION)."""
    return skip_repeated_patching() and skip_overflow_checks() and defer_type_bookkeeping()


def defer_type_bookkeeping() -> bool:
    """Type names, tuple types and the interpreter's dtype table made on first use → installed."""
    import functools

    import numpy as np
    import triton
    import triton.language as tl
    from triton._utils import validate_block_shape
    from triton.language import core
    from triton.runtime import interpreter as ti

    if triton.__version__ != VERSION:
        return False
    if getattr(core.block_type.__init__, "defers_names", False):
        return True
    own = {"block_type": core.block_type.__init__, "tuple_type": core.tuple_type.__init__,
           "tuple": core.tuple.__init__, "np_dtype": ti._get_np_dtype}

    def block_type_init(self, element_ty, shape):  # block_type.__init__ less its name
        self.element_ty = element_ty
        assert isinstance(shape, (list, core.tuple))  # the module's `tuple` is tl.tuple
        values = shape.values if isinstance(shape, core.tuple) else shape
        if all(type(d) is int for d in values):  # what _unwrap_shape returns for them
            unwrapped = list(values)
        else:
            unwrapped = core._unwrap_shape(shape)
        self.shape = core.tuple(unwrapped)  # a tl.tuple, as the module's own `tuple` makes
        if not self.shape:
            raise TypeError("0d block_type is forbidden")
        self.numel = validate_block_shape(self.shape)

    def tuple_type_init(self, types, fields=None):  # tuple_type.__init__ less its name
        self.types = types
        self.fields = fields or [""] * len(types)

    def tuple_init(self, args, type=None):
        if type is not None:
            return own["tuple"](self, args, type)
        self.values = [v for v in args]
        if any(isinstance(v, core.tuple) for v in self.values):
            self.type = core._type_for_tuple_values(self.values)

    table = {t: own["np_dtype"](t) for t in (
        tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16,
        tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16,
        tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):  # _get_np_dtype with its table built once
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return pointer
            return table[tt_dtype.element_ty]
        return table[tt_dtype]

    def lazy(cls, attr, make):
        prop = functools.cached_property(make)  # non-data: an assignment still wins
        prop.__set_name__(cls, attr)
        setattr(cls, attr, prop)

    lazy(core.block_type, "name", lambda t: f"<{t.shape}, {t.element_ty}>")
    lazy(core.tuple_type, "name", lambda t: "[" + ",".join(
        [f"{k}:{v}" for k, v in zip(t.fields, t.types, strict=False)]) + "]")
    lazy(core.tuple, "type", lambda t: core._type_for_tuple_values(t.values))
    block_type_init.defers_names = True
    block_type_init.original, tuple_type_init.original = own["block_type"], own["tuple_type"]
    tuple_init.original, get_np_dtype.original = own["tuple"], own["np_dtype"]
    core.block_type.__init__, core.tuple_type.__init__ = block_type_init, tuple_type_init
    core.tuple.__init__, ti._get_np_dtype = tuple_init, get_np_dtype
    return True


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
