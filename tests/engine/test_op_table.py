"""The op table (iquestrt/ops.py `OpTable`) is a contract: both implementations and every table
that stands in for one take exactly the declared parameters, so a caller written against the
declaration runs on any of them. Read from the signatures; nothing runs an op here."""

from __future__ import annotations

import inspect

import pytest
import torch

from benchmarks.rank.ops import RankKernelOps, RankTwinOps
from iquestrt.ops import KernelOps, OpTable, TwinOps
from iquestrt.tp.engine import TPOps
from qualification.lockstep import Lockstep
from qualification.plants import PlantedOps
from qualification.virtual_tp import VirtualShardOps

OPS = sorted(n for n, v in vars(OpTable).items() if inspect.isfunction(v)
             and not n.startswith("_"))


def _params(fn) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter after self; annotations are not compared."""
    ps = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in ps]


def mismatches(impl: type) -> list[str]:
    """Where a full implementation departs from OpTable: a missing op, other parameters, or a
    public method the table does not declare (an op outside the contract)."""
    out = []
    for op in OPS:
        if not callable(getattr(impl, op, None)):
            out.append(f"{impl.__name__}.{op}: missing")
        elif _params(getattr(impl, op)) != _params(getattr(OpTable, op)):
            out.append(f"{impl.__name__}.{op}{inspect.signature(getattr(impl, op))} != "
                       f"OpTable.{op}{inspect.signature(getattr(OpTable, op))}")
    extra = [n for n, v in inspect.getmembers(impl, inspect.isfunction)
             if not n.startswith("_") and n not in OPS]
    out += [f"{impl.__name__}.{n}: not an op of OpTable" for n in extra]
    return out


def refusals(wrapper: type) -> list[str]:
    """The ops a wrapper defines itself (not through its base table) that would refuse a call
    made as the declaration allows: required parameters by position, every optional and
    keyword-only one by name."""
    out = []
    for op in OPS:
        fn = inspect.getattr_static(wrapper, op, None)
        if fn is None or inspect.getattr_static(KernelOps, op, None) is fn \
                or inspect.getattr_static(TwinOps, op, None) is fn:
            continue
        pos, kw = [], {}
        for name, kind, default in _params(getattr(OpTable, op)):
            if kind is inspect.Parameter.KEYWORD_ONLY or default is not inspect.Parameter.empty:
                kw[name] = None
            else:
                pos.append(None)
        try:
            inspect.signature(fn).bind(None, *pos, **kw)
        except TypeError as e:
            out.append(f"{wrapper.__name__}.{op}: {e}")
    return out


def test_the_table_declares_the_ops_the_model_calls():
    assert len(OPS) == 27
    assert {"reset", "linear_fp8", "attn_tail", "sample", "verify", "check_logits",
            "record_draft", "settle_round", "check_flags", "begin_round", "target_rows",
            "settle_bounds"} <= set(OPS)


@pytest.mark.parametrize("impl", [KernelOps, TwinOps], ids=lambda c: c.__name__)
def test_implementations_match_the_declaration(impl):
    assert mismatches(impl) == []


def test_instances_satisfy_the_protocol():
    assert isinstance(TwinOps(torch.device("cpu"), 1), OpTable)
    assert isinstance(KernelOps(torch.device("cpu"), 1), OpTable)  # the interpreter is on


@pytest.mark.parametrize("wrapper", [Lockstep, TPOps, VirtualShardOps, PlantedOps,
                                     RankKernelOps, RankTwinOps], ids=lambda c: c.__name__)
def test_wrappers_accept_every_declared_call(wrapper):
    assert refusals(wrapper) == []


def test_lockstep_compares_every_op():
    """An op the lockstep table does not define itself would reach the kernels through its
    __getattr__ unjudged (reset has nothing to compare)."""
    assert [op for op in OPS if op not in vars(Lockstep) and op != "reset"] == []


def test_the_checks_catch_a_departure():
    class Renamed(TwinOps):
        def moe(self, x, weights, ids, m, live, out_dtype, xq=None, buf=None):
            raise AssertionError

        def extra_op(self):
            raise AssertionError

    class Narrow:
        def sample(self, logits, params, seed, positions, live):  # purpose missing
            raise AssertionError

    got = mismatches(Renamed)
    assert len(got) == 2 and got[0].startswith("Renamed.moe(") and "extra_op" in got[1]
    assert [r.split(":")[0] for r in refusals(Narrow)] == ["Narrow.sample"]
