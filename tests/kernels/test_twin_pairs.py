"""Every kernel family pairs with its twin family: `kernels/<family>.py` ↔
`reference/twins/<family>.py`, found from the wrappers' own `@twin` marks (kernels/twin.py).
Nothing runs a kernel here."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TWIN_FAMILIES = sorted(p.stem for p in (REPO / "reference/twins").glob("*.py")
                       if p.stem != "__init__")
# kernel modules with Triton code but no wrapper of their own: each one's kernels are launched
# by (or inlined into) the family named, whose wrappers carry the twin
HELPERS = {
    "router": "tails",  # the router folded into attn_tail (and rows.route_rows' kernel)
    "readiness": "tails",  # the NaN-readiness poll inlined into the tails
    "peer_partials": "tails",  # the tails' table of peer slots
    "launch": "rows",  # pdl_enter, the griddepcontrol wait every PDL kernel inlines
    "timeline": "tails",  # the timestamps a traced tail stores (no value of the op changes)
    "row_chunks": "tails",  # the tails' column-chunk rows (the row program's values, staged)
    "arrival": "qk_rope",  # the last-arrival handoff (row_chunks, and qkv_rope's fold)
}
# an op whose twins-table call is another twin with the same values, and why
SAME_VALUES = {
    "linear_fp8_partials": ("linear_fp8_ref", "the twin is one GEMM: a single partial, whose "
                            "sum is linear_fp8's value"),
    "qkv_rope": ("qk_rope_ref", "the twins table runs its own linear_fp8_partials and qk_rope "
                 "(qkv_rope_ref's composition), so a stand-in replacing qk_rope reaches it"),
    "rollback_layers": ("rollback_ref", "the twins table rolls each cache back through its own "
                        "rollback (rollback_layers_ref's loop), so a stand-in replacing "
                        "rollback reaches every layer"),
}


def _wrappers(family: str) -> dict[str, object]:
    mod = importlib.import_module(f"kernels.{family}")
    return {n: f for n, f in vars(mod).items()
            if inspect.isfunction(f) and f.__module__ == mod.__name__ and hasattr(f, "twin")}


def _triton_modules() -> list[str]:
    """The kernel families holding Triton code: a module of kernels/, or a package of it (its
    files are one family, e.g. kernels/sampler/)."""
    root = REPO / "kernels"
    return sorted({p.stem if p.parent == root else p.relative_to(root).parts[0]
                   for p in root.rglob("*.py") if "@triton.jit" in p.read_text()})


@pytest.mark.parametrize("family", TWIN_FAMILIES)
def test_each_twin_family_has_its_kernel_family(family):
    wrappers = _wrappers(family)
    assert wrappers, f"kernels/{family}.py names no twin of reference/twins/{family}.py"
    for name, w in wrappers.items():
        assert w.twin.__module__ == f"reference.twins.{family}", (name, w.twin.__module__)
        assert w.twin.__name__ == f"{name}_ref" or w.twin.__name__.endswith("_ref"), name


def test_every_kernel_module_is_paired_or_serves_a_paired_family():
    unpaired = [m for m in _triton_modules() if m not in TWIN_FAMILIES and m not in HELPERS]
    assert unpaired == []
    assert all(HELPERS[m] in TWIN_FAMILIES for m in HELPERS)


def test_the_ops_tables_call_the_pairs():
    """Each op of the kernels table calls a wrapper whose twin the twins table calls: the op
    table (iquestrt/ops.py) is the pairs, row by row, and the lockstep gate compares them."""
    src_k = (REPO / "iquestrt/ops_kernels.py").read_text()
    src_t = (REPO / "iquestrt/ops_twins.py").read_text()
    missing = []
    for family in TWIN_FAMILIES:
        for name, w in _wrappers(family).items():
            ref = SAME_VALUES.get(name, (w.twin.__name__,))[0]
            if f".{name}(" in src_k and f".{ref}(" not in src_t:
                missing.append(f"{family}.{name} → {w.twin.__name__}")
    assert missing == []
