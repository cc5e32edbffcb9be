"""The per-kernel breakdown's grouping: every kernel a round launches has a family."""

import ast
from pathlib import Path

import pytest

from benchmarks.rank.measure import breakdown, family

KERNELS = Path(__file__).resolve().parents[3] / "kernels"
NOT_IN_A_ROUND = {"_prefetch_scores_kernel", "_prefetch_select_kernel", "_prefetch_warm_kernel",
                  "_dequant_block_kernel"}  # prefetch is off in the benchmark; dequant: tests


def _launched_kernels() -> set[str]:
    names = set()
    for f in KERNELS.rglob("*.py"):  # family packages (attention/, sampler/) too
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                names.add(node.name)
    return names - NOT_IN_A_ROUND


def test_every_round_kernel_has_a_family():
    names = _launched_kernels()
    assert len(names) >= 20
    assert {n: family(n) for n in names if family(n) == "other"} == {}
    assert family("_moe_tail_kernel") == "tails" and family("_moe_combine_kernel") == "moe"
    assert family("void at::native::elementwise_kernel<...>") == "torch"
    assert family("_settle_bounds_kernel") == "round_scalars"
    assert family("_settle_kernel") == "round_record"
    assert family("something_new") == "other"  # unknown names are not silently absorbed


def test_breakdown_sums_by_kernel_and_family():
    ev = [("_moe_gate_up_kernel", 2e-5), ("_moe_down_kernel", 1e-5), ("_moe_gate_up_kernel", 3e-5),
          ("_split_kernel", 4e-6), ("Memset (Device)", 1e-6)]
    b = breakdown(ev)
    assert b.launches == 5 and b.kernel_s == pytest.approx(6.5e-5)
    assert b.by_kernel["_moe_gate_up_kernel"] == (2, pytest.approx(5e-5))
    assert list(b.by_kernel)[0] == "_moe_gate_up_kernel"  # largest first
    assert b.by_family["moe"] == (3, pytest.approx(6e-5))
    assert b.by_family["attention"][0] == 1 and b.by_family["torch"][0] == 1
