"""Programmatic dependent launch, checked without a GPU: every kernel the package launches takes
the PDL constexpr and enters through `pdl_enter` before anything else, every launch passes
`launch_opts`, the refusals, and an sm_90 build whose `griddepcontrol.wait` precedes every
global memory access. (That PDL changes no bit is tests/engine/test_engine_pdl.py, on the GPU.)"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import torch

from kernels.launch import check_pdl, launch_opts
from tests.kernels.sm90 import compile_sm90

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _launches(kernels: Path) -> dict[str, list[tuple[str, ast.Call]]]:
    """<module> → [(kernel name, the launch call)] for every `name_kernel[grid](...)`."""
    out = {}
    for path in sorted(kernels.rglob("*.py")):  # family packages (attention/, sampler/) too
        parts = path.relative_to(kernels).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id.endswith("_kernel")):
                out.setdefault(module, []).append((node.func.value.id, node))
    return out


def _functions(kernels: Path) -> dict[str, ast.FunctionDef]:
    """Every module-level function of the package by name (a kernel may be launched from a
    module it is imported into)."""
    out = {}
    for path in sorted(kernels.rglob("*.py")):
        out.update({f.name: f for f in ast.parse(path.read_text()).body
                    if isinstance(f, ast.FunctionDef)})
    return out


MEMORY_OPS = {"load", "store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max",
              "atomic_min", "atomic_and", "atomic_or", "atomic_xor"}


def _prefetch_hint(stmt: ast.stmt, fns: dict[str, ast.FunctionDef]) -> bool:
    """`if FLAG: prefetch_…(…)`: an L2 hint of the kernel's own weights (kernels/launch.py
    prefetch_l2), allowed before the wait — when the helpers it calls hold no memory op."""
    if not (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Name) and not stmt.orelse):
        return False
    for s in stmt.body:
        name = getattr(getattr(s, "value", None), "func", None)
        name = getattr(name, "id", "")
        if not (isinstance(s, ast.Expr) and name.startswith("prefetch") and name in fns):
            return False
        if any(isinstance(n, ast.Attribute) and n.attr in MEMORY_OPS
               for n in ast.walk(fns[name])):
            return False
    return True


def _enters_through_pdl(f: ast.FunctionDef, fns: dict[str, ast.FunctionDef]) -> bool:
    """pdl_enter(PDL[, RELEASE]) is the first statement after the docstring and any prefetch
    hints."""
    body = f.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    while body and _prefetch_hint(body[0], fns):
        body = body[1:]
    first = body[0]
    args = [getattr(a, "id", None) for a in getattr(getattr(first, "value", None), "args", [])]
    return (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
            and getattr(first.value.func, "id", None) == "pdl_enter"
            and args[:1] == ["PDL"] and None not in args)


def pdl_violations(kernels: Path) -> list[str]:
    launches, fns = _launches(kernels), _functions(kernels)
    bad = []
    for module, calls in launches.items():
        for name, call in calls:
            f = fns[name]
            has_param = "PDL" in [a.arg for a in f.args.args]
            opts = any(k.arg is None and isinstance(k.value, ast.Call)
                       and getattr(k.value.func, "id", None) == "launch_opts"
                       for k in call.keywords)
            first = _enters_through_pdl(f, fns)
            if not (has_param and first and opts):
                bad.append(f"{module}.{name}: PDL param {has_param}, pdl_enter first "
                           f"{first}, launch_opts at the launch {opts}")
    return bad


def test_every_launched_kernel_enters_through_pdl():
    assert sum(len(v) for v in _launches(KERNELS).values()) >= 25
    bad = pdl_violations(KERNELS)
    assert not bad, "\n".join(bad)


def test_the_check_can_fail(tmp_path):
    """A kernel that loads before pdl_enter, and a launch without launch_opts, are reported."""
    # the whole package (rows.py launches router.py's route kernel)
    shutil.copytree(KERNELS, tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    src = (KERNELS / "rows.py").read_text()
    early = src.replace("    pdl_enter(PDL)\n", "    tl.load(n_live_ptr)\n    pdl_enter(PDL)\n", 1)
    assert early != src
    (tmp_path / "rows.py").write_text(early)
    assert any(b.startswith("rows.") and "pdl_enter first False" in b
               for b in pdl_violations(tmp_path))
    bare = src.replace("**launch_opts(", "**dict(", 1)
    assert bare != src
    (tmp_path / "rows.py").write_text(bare)
    assert any("launch_opts at the launch False" in b for b in pdl_violations(tmp_path))
    (tmp_path / "rows.py").write_text(src)
    # a "prefetch" before the wait that loads, and one whose helper loads, are no hints
    lin = (KERNELS / "linear.py").read_text()
    hint = "    if PREFETCH:  # before the PDL wait: the weights are no predecessor's output\n"
    assert lin.count(hint) == 1 and not pdl_violations(tmp_path)
    (tmp_path / "linear.py").write_text(lin.replace(hint, hint + "        tl.load(w_ptr)\n"))
    assert any(b.startswith("linear._linear_fp8_kernel") and "pdl_enter first False" in b
               for b in pdl_violations(tmp_path))
    call = "    prefetch_l2(w_ptr + c.to"
    helper = lin.replace(call, "    tl.load(w_ptr)\n" + call)
    assert helper != lin
    (tmp_path / "linear.py").write_text(helper)
    assert any(b.startswith("linear._linear_fp8_kernel") and "pdl_enter first False" in b
               for b in pdl_violations(tmp_path))


def test_launch_opts_and_refusals():
    assert launch_opts(False) == {"PDL": False}
    assert launch_opts(True, enable_fp_fusion=False) == {"PDL": True, "launch_pdl": True,
                                                          "enable_fp_fusion": False}
    check_pdl(False, "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        check_pdl(True, "cpu")


def test_runtime_config_and_ops_refuse_pdl_off_the_gpu_kernels():
    from iquestrt.config import RuntimeConfig, RuntimeConfigError
    from iquestrt.ops import make_ops

    with pytest.raises(RuntimeConfigError, match="RuntimeConfig.pdl: .*ops='kernels' on a CUDA"):
        RuntimeConfig(ops="kernels", device="cpu", pdl=True)
    with pytest.raises(RuntimeConfigError, match="RuntimeConfig.pdl"):
        RuntimeConfig(ops="twins", device="cuda", pdl=True)
    with pytest.raises(RuntimeConfigError, match="must be a bool"):
        RuntimeConfig(pdl=1)
    with pytest.raises(RuntimeConfigError, match="must be a bool or None"):
        RuntimeConfig(pdl="on")
    with pytest.raises(ValueError, match="pdl .* needs the 'kernels' backend"):
        make_ops("twins", "cpu", 8, pdl=True)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_ops("kernels", "cpu", 8, pdl=True)


@pytest.mark.parametrize("ops, device, cuda, capability, want", [
    ("kernels", "cuda", True, (9, 0), True),
    ("kernels", "cuda", True, (10, 0), True),
    ("kernels", "cuda", True, (8, 9), False),  # Ada: no griddepcontrol
    ("kernels", "cuda", False, (9, 0), False),  # no CUDA device visible
    ("kernels", "cpu", True, (9, 0), False),  # the interpreter
    ("twins", "cuda", True, (9, 0), False),
])
def test_pdl_defaults_to_on_exactly_where_it_can_run(monkeypatch, ops, device, cuda, capability,
                                                     want):
    """RuntimeConfig.pdl None resolves at construction: on for compiled kernels on compute
    capability >= 9.0, off elsewhere; an explicit value is kept."""
    from iquestrt.config import RuntimeConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    assert RuntimeConfig(ops=ops, device=device).pdl is want
    assert RuntimeConfig(ops=ops, device=device, pdl=False).pdl is False


_SM90 = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import rows

res = {}
for pdl in (False, True):
    fn = rows._silu_mul_kernel
    sig = {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16", "n_live_ptr": "*i32"}
    const = {"F": 768, "BLOCK_F": 1024, "PDL": pdl}
    full = {a: "constexpr" if a in const else sig.get(a, "i32") for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, full, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, launch_pdl=pdl))
    ptx = k.asm["ptx"]
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    wait = body.find("griddepcontrol.wait")
    trig = body.find("griddepcontrol.launch_dependents")
    mem = min([m.start() for m in re.finditer(r"\b(ld|st)\.global", body)] or [-1])
    res[str(pdl)] = {"wait": wait, "trigger": trig, "first_mem": mem,
                     "launch_pdl": bool(k.metadata.launch_pdl)}
print(json.dumps(res))
"""


@pytest.mark.slow
def test_sm90_build_waits_before_any_global_access():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its NVIDIA backend")
    got = compile_sm90(_SM90)
    off, on = got["False"], got["True"]
    assert off["wait"] == -1 and off["trigger"] == -1 and not off["launch_pdl"]
    assert on["launch_pdl"] and on["first_mem"] > 0
    assert 0 <= on["wait"] < on["first_mem"], on
    assert on["trigger"] == -1  # no early trigger: it measured slower (kernels/launch.py)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_check_pdl_accepts_hopper():
    check_pdl(True, "cuda")
