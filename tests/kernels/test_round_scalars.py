"""kernels/round_scalars.py against its twins (reference.twins.round_scalars), bit for bit (row
kernels.round_scalars), and against values written out by hand: where a round's depths begin,
its verification rows, its rollback bounds — for a running and a finished request, keep and
recompute settlements, no draft run. Planted defects (a position off by one, the wrong
settlement) must differ from the kernels.

Dimension letters: R rows, Db = R − 1 draft slots, W served width.
"""

from __future__ import annotations

import pytest
import torch

from kernels.round_scalars import begin_round, settle_bounds, target_rows
from reference.op_types import (
    DraftRecord,
    RoundBegin,
    RoundState,
    SettleBounds,
    TargetRows,
    VerifyOut,
)
from reference.twins.round_scalars import begin_round_ref, settle_bounds_ref, target_rows_ref
from tests.kernels.sm90 import compile_sm90

R, WIDTH = 6, 3  # rows, served width (Db = 5 draft slots)


def _state(device, *, m=10, draft_next=9, hidden_at=8, done=0) -> RoundState:
    i32 = dict(dtype=torch.int32, device=device)
    one = lambda v: torch.tensor([v], **i32)  # noqa: E731
    return RoundState(
        tokens=(100 + torch.arange(40, dtype=torch.int64)).to(device),
        stop=torch.tensor([-2], dtype=torch.int64, device=device), m=one(m),
        draft_next=one(draft_next), hidden=torch.zeros(R, 8, dtype=torch.bfloat16, device=device),
        hidden_at=one(hidden_at), n_new=one(3), max_new=one(50), done=one(done),
        round_no=one(2), fault=torch.zeros(4, dtype=torch.int64, device=device),
        head=torch.zeros(2, 5, **i32), emitted=torch.full((2, R), -1, dtype=torch.int64,
                                                          device=device),
        drafts=torch.zeros(2, R - 1, dtype=torch.int64, device=device),
        q_ids=torch.full((2, R - 1, WIDTH), -1, dtype=torch.int64, device=device),
        q_probs=torch.zeros(2, R - 1, WIDTH, device=device))


def _record(device, n_d=3, seed=0) -> DraftRecord:
    """A record left by earlier depths: random q rows, drafts 21 …, n_d drafts run."""
    g = torch.Generator().manual_seed(seed)
    return DraftRecord(torch.randint(0, 99, (R - 1, WIDTH), generator=g).to(device),
                       torch.rand(R - 1, WIDTH, generator=g).to(device),
                       (21 + torch.arange(R - 1, dtype=torch.int64)).to(device),
                       torch.tensor([n_d], dtype=torch.int32, device=device))


def _begin(device, fill=-7) -> RoundBegin:
    """Buffers holding garbage (fill) that every field must overwrite."""
    i32 = dict(dtype=torch.int32, device=device)
    return RoundBegin(torch.full((1,), fill, **i32), torch.full((1,), fill, **i32),
                      torch.full((1,), fill, **i32),
                      torch.full((1,), fill, dtype=torch.int64, device=device),
                      torch.full((R - 1,), fill, **i32),
                      torch.full((1, 3), float(fill), device=device))


def _target(device, fill=-7) -> TargetRows:
    i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
    return TargetRows(torch.full((1,), fill, **i32), torch.full((R,), fill, **i64),
                      torch.full((R,), fill, **i32), torch.full((R,), fill, **i64),
                      torch.full((1,), fill, **i64), torch.full((1,), fill, **i32))


def _bounds(device) -> SettleBounds:
    return SettleBounds(*(torch.full((1,), -7, dtype=torch.int32, device=device)
                          for _ in SettleBounds._fields))


def _verify(device, a) -> VerifyOut:
    return VerifyOut(torch.tensor([a], dtype=torch.int32, device=device),
                     torch.tensor([77], device=device),
                     torch.zeros(1, dtype=torch.int32, device=device),
                     torch.full((R,), -1, dtype=torch.int64, device=device))


def _clone(t):
    return type(t)(*(x.clone() for x in t))


def _same(got, want) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _begin_both(device, s, clear_from, ref=begin_round_ref):
    """→ (kernel's (b, rec), ref's (b, rec)) from the same buffers, each on its own copy."""
    b, rec = _begin(device), _record(device)
    kb, kr, tb, tr = _clone(b), _clone(rec), _clone(b), _clone(rec)
    begin_round(s, kr, kb, clear_from=clear_from)
    ref(s, tr, tb, clear_from=clear_from)
    return (kb, kr), (tb, tr), rec


# --- begin_round ----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["keep c 2", "c 1", "recompute c 4", "finished"])
@pytest.mark.parametrize("clear_from", [R - 1, 2, 0])
def test_begin_round(device, case, clear_from):
    dn, done = {"keep c 2": (9, 0), "c 1": (10, 0), "recompute c 4": (7, 0),
                "finished": (9, 1)}[case]
    s = _state(device, m=10, draft_next=dn, hidden_at=dn - 3, done=done)
    (kb, kr), (tb, tr), before = _begin_both(device, s, clear_from)
    assert _same(kb, tb) and _same(kr, tr)
    go = 1 - done
    c = (10 - dn + 1) * go
    assert (int(kb.go[0]), int(kb.c[0]), int(kb.hid_base[0]), int(kb.last[0])) == (
        go, c, 2, max(c - 1, 0))
    assert kb.pos.tolist() == [dn + c + j for j in range(R - 1)]
    assert kb.feat.tolist() == [[1.0, 0.0, 0.0]]
    assert kr.drafts.tolist() == [0] * (R - 1) and int(kr.n_d[0]) == 0
    assert torch.equal(kr.q_ids[:clear_from], before.q_ids[:clear_from])
    assert torch.equal(kr.q_probs[:clear_from], before.q_probs[:clear_from])
    assert (kr.q_ids[clear_from:] == -1).all() and (kr.q_probs[clear_from:] == 0).all()


# --- target_rows ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n_d, done", [(3, 0), (1, 0), (R - 1, 0), (0, 0), (2, 1)])
def test_target_rows(device, n_d, done):
    s = _state(device, m=10, draft_next=9, done=done)
    b = _begin(device)
    begin_round_ref(s, _record(device), b, clear_from=R - 1)  # pos = 9 + c + j, c = 2·go
    rec = _record(device, n_d=n_d)
    kt, tt = _target(device), _target(device)
    target_rows(s, rec, b, kt)
    target_rows_ref(s, rec, b, tt)
    assert _same(kt, tt)
    n_t = (n_d + 1) * (1 - done)
    assert int(kt.n_t[0]) == n_t
    assert kt.tokens.tolist() == [110] + [21 + r for r in range(R - 1)]  # x_m = tokens[m]
    assert kt.pos.tolist() == [10 + r if r < n_t else -1 for r in range(R)]
    assert kt.sample_pos.tolist() == [11 + r for r in range(R)] and int(kt.first[0]) == 11
    pos0 = 9 + 2 * (1 - done)
    assert int(kt.nxt[0]) == (pos0 + n_d - 1 if n_d > 0 else 9)


# --- settle_bounds --------------------------------------------------------------------------------
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("a, go, nxt", [(0, 1, 14), (2, 1, 14), (4, 1, 13), (3, 0, 9)])
def test_settle_bounds(device, recompute, a, go, nxt):
    s = _state(device, m=10)
    t = _target(device)
    t.n_t.fill_(5 * go)
    t.nxt.fill_(nxt)
    g = torch.tensor([go], dtype=torch.int32, device=device)
    ko, to = _bounds(device), _bounds(device)
    settle_bounds(_verify(device, a), s, t, g, ko, recompute=recompute)
    settle_bounds_ref(_verify(device, a), s, t, g, to, recompute=recompute)
    assert _same(ko, to)
    n_em = (a + 1) * go
    settled = 10 + go if recompute else 10 + n_em
    assert [int(x[0]) for x in ko] == [10 + n_em, 10 + 5 * go, min(settled, nxt)]


# --- planted defects ------------------------------------------------------------------------------
def _pos_off_by_one(s, rec, b, *, clear_from):
    begin_round_ref(s, rec, b, clear_from=clear_from)
    b.pos.add_(1)


def _q_rows_kept(s, rec, b, *, clear_from):
    begin_round_ref(s, rec, b, clear_from=rec.q_ids.shape[0])


@pytest.mark.parametrize("mutant", [_pos_off_by_one, _q_rows_kept], ids=lambda f: f.__name__)
def test_a_broken_begin_differs(device, mutant):
    (kb, kr), (mb, mr), _ = _begin_both(device, _state(device), 1, ref=mutant)
    assert not (_same(kb, mb) and _same(kr, mr))


def test_a_broken_bound_differs(device):
    """The draft's bound of the other settlement, or the next position one past the last draft:
    the kernel's values differ."""
    s, t, g = _state(device), _target(device), torch.ones(1, dtype=torch.int32, device=device)
    t.n_t.fill_(4)
    t.nxt.fill_(14)
    keep, other = _bounds(device), _bounds(device)
    settle_bounds(_verify(device, 2), s, t, g, keep, recompute=False)
    settle_bounds(_verify(device, 2), s, t, g, other, recompute=True)
    assert not torch.equal(keep.keep_d, other.keep_d)
    b = _begin(device)
    begin_round_ref(_state(device), _record(device), b, clear_from=R - 1)
    kt = _target(device)
    target_rows(_state(device), _record(device, n_d=3), b, kt)
    assert int(kt.nxt[0]) != int(b.pos[0]) + 3


# --- bad input ------------------------------------------------------------------------------------
def test_bad_input_names_the_argument(device):
    s, rec, b, t = _state(device), _record(device), _begin(device), _target(device)
    with pytest.raises(ValueError, match="clear_from"):
        begin_round(s, rec, b, clear_from=R)
    with pytest.raises(ValueError, match="b.pos"):
        begin_round(s, rec, b._replace(pos=b.pos[:2]), clear_from=0)
    with pytest.raises(ValueError, match="s.done"):
        begin_round(s._replace(done=s.done.long()), rec, b, clear_from=0)
    with pytest.raises(ValueError, match="rec.q_ids"):
        begin_round(s, rec._replace(q_ids=rec.q_ids.t().contiguous().t()), b, clear_from=0)
    with pytest.raises(ValueError, match="t.tokens"):
        target_rows(s, rec, b, t._replace(tokens=t.tokens[:3]))
    with pytest.raises(ValueError, match="t.first"):
        target_rows(s, rec, b, t._replace(first=t.first.int()))
    g = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="go"):
        settle_bounds(_verify(device, 1), s, t, g.long(), _bounds(device), recompute=False)
    with pytest.raises(ValueError, match="recompute"):
        settle_bounds(_verify(device, 1), s, t, g, _bounds(device), recompute=1)


@pytest.mark.gpu
def test_graph_replays_read_new_values(device):
    """Captured once, replayed after the state moved: each replay derives the new values (the
    round graph's use)."""
    from iquestrt.capture import graph_capture

    s, rec, b, t = _state(device), _record(device), _begin(device), _target(device)
    begin_round(s, rec, b, clear_from=2)  # compile outside the capture
    target_rows(s, rec, b, t)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        begin_round(s, rec, b, clear_from=2)
        target_rows(s, rec, b, t)
    s.m.fill_(20)
    s.draft_next.fill_(18)
    graph.replay()
    torch.cuda.synchronize()
    assert int(b.c[0]) == 3 and b.pos.tolist() == [21 + j for j in range(R - 1)]
    assert t.pos.tolist()[0] == 20 and int(t.nxt[0]) == 18  # n_d was zeroed: none ran


_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.round_scalars as K

i64 = {"last_ptr", "d_ptr", "qi_ptr", "tok_ptr", "ttok_ptr", "spos_ptr", "first_ptr"}
consts = {"BLOCK_DB": 8, "BLOCK_Q": 32, "BLOCK_R": 8, "RECOMPUTE": True, "PDL": False}
out = {}
for fn in (K._begin_kernel, K._target_rows_kernel, K._settle_bounds_kernel):
    sig = {n: "constexpr" if n in consts else ("*i64" if n in i64 else "*fp32"
           if n in ("feat_ptr", "qp_ptr") else "*i32" if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={n: consts[n] for n in fn.arg_names if n in consts})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    out[fn.__name__] = k.asm["ptx"].count("st.global")
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """The interpreter runs them above; the compiler types every branch (the constexpr
    settlement, selects of int32 and int64): compiled for sm_90 in a fresh process, each
    storing to global memory."""
    got = compile_sm90(_COMPILE)
    assert set(got) == {"_begin_kernel", "_target_rows_kernel", "_settle_bounds_kernel"}
    assert all(n >= 3 for n in got.values()), got
