"""kernels/round_record.py against its twins (reference.twins.round_record), bit for bit (row
kernels.round_record), and against values written out by hand: the fault of non-finite logits
in live rows only, never over an earlier fault, with the round it happened in; a draft step's
record with the token clamped, and nothing but −1 / 0 when the depth did not run.

Dimension letters: R rows, V vocabulary, W served width, Db draft slots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from iquestrt.capture import graph_capture
from kernels.round_record import BLOCK_V, check_flags, check_logits, record_draft, settle_round
from reference.op_types import DraftRecord, FaultLog, RoundState, SampleOut, VerifyOut
from reference.twins.round_record import (
    check_flags_ref,
    check_logits_ref,
    record_draft_ref,
    record_fault_ref,
    settle_round_ref,
)

CODE, VOCAB = 3, 5000  # V spans two check_logits programs (BLOCK_V 4096)


def _log(device, fault=(0, 0, 0, 0), rnd=7) -> FaultLog:
    return FaultLog(torch.tensor(fault, dtype=torch.int64, device=device),
                    torch.tensor([rnd], dtype=torch.int32, device=device))


def _clone(t):
    return type(t)(*(x.clone() for x in t))


def _check_both(device, logits, n, log, where=2):
    """→ (kernel's log, twin's log) after each checked the same logits on its own copy."""
    n = torch.tensor([n], dtype=torch.int32, device=device)
    k, t = _clone(log), _clone(log)
    check_logits(logits, n, k, code=CODE, where=where)
    check_logits_ref(logits, n, t, code=CODE, where=where)
    return k, t


def _logits(device, rows=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["finite", "nan live", "inf last column", "-inf second block",
                                  "nan dead row", "earlier fault", "no live row"])
def test_check_logits(device, dtype, case):
    x = _logits(device, dtype=dtype)
    n, log, want = 3, _log(device), (0, 0, 0, 0)
    if case == "nan live":
        x[1, 17] = float("nan")
        want = (CODE, 7, 2, 0)
    elif case == "inf last column":
        x[2, VOCAB - 1] = float("inf")
        want = (CODE, 7, 2, 0)
    elif case == "-inf second block":
        x[0, BLOCK_V + 3] = float("-inf")
        want = (CODE, 7, 2, 0)
    elif case == "nan dead row":
        x[3, 5] = float("nan")  # row 3 ≥ n: padding, never judged
    elif case == "earlier fault":
        x[0, 0] = float("nan")
        log = _log(device, fault=(1, 4, 9, 0))
        want = (1, 4, 9, 0)
    elif case == "no live row":
        x[0, 0] = float("nan")
        n = 0
    k, t = _check_both(device, x, n, log)
    assert k.fault.tolist() == list(want)
    assert torch.equal(k.fault, t.fault) and torch.equal(k.round_no, t.round_no)


@pytest.mark.parametrize("layers", [1, 5, 88])
@pytest.mark.parametrize("case", ["none", "one", "two", "not run", "earlier fault"])
def test_check_flags(device, layers, case):
    flags = torch.zeros(layers, dtype=torch.int32, device=device)
    if case != "none":
        flags[layers - 1] = 1
        if case == "two" and layers > 2:
            flags[2] = 7  # the first raised flag is named
    ran = torch.tensor([0 if case == "not run" else 1], dtype=torch.int32, device=device)
    log = _log(device, fault=(2, 3, 0, 0)) if case == "earlier fault" else _log(device)
    k, t = _clone(log), _clone(log)
    check_flags(flags, ran, k, code=1)
    check_flags_ref(flags, ran, t, code=1)
    assert torch.equal(k.fault, t.fault)
    first = 2 if case == "two" and layers > 2 else layers - 1
    want = {"none": [0, 0, 0, 0], "not run": [0, 0, 0, 0], "earlier fault": [2, 3, 0, 0]}
    assert k.fault.tolist() == want.get(case, [1, 7, first, 0])


def _sample(device, token, width, seed=1) -> SampleOut:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, width), generator=g)
    probs = torch.rand(4, width, generator=g)
    tokens = torch.tensor([token, 11, 12, 13], dtype=torch.int64)
    return SampleOut(tokens.to(device), ids.to(device), probs.to(device))


def _record(device, db=5, width=3, n_d=2) -> DraftRecord:
    return DraftRecord(torch.full((db, width), -1, dtype=torch.int64, device=device),
                       torch.zeros(db, width, dtype=torch.float32, device=device),
                       torch.zeros(db, dtype=torch.int64, device=device),
                       torch.tensor([n_d], dtype=torch.int32, device=device))


def _draft_both(device, out, one, j, rec, log):
    one = torch.tensor([one], dtype=torch.int32, device=device)
    kr, kl, tr, tl = _clone(rec), _clone(log), _clone(rec), _clone(log)
    record_draft(out, one, j, kr, kl, vocab=VOCAB, code=CODE)
    record_draft_ref(out, one, j, tr, tl, vocab=VOCAB, code=CODE)
    return (kr, kl), (tr, tl)


@pytest.mark.parametrize("width", [1, 3, 20])
@pytest.mark.parametrize("case", ["in range", "too large", "negative", "not run",
                                  "earlier fault"])
def test_record_draft(device, width, case):
    token = {"too large": VOCAB + 4, "negative": -3}.get(case, 4321)
    one = 0 if case == "not run" else 1
    log = _log(device, fault=(2, 1, 0, 0)) if case == "earlier fault" else _log(device)
    out, rec = _sample(device, token, width), _record(device, width=width)
    (kr, kl), (tr, tl) = _draft_both(device, out, one, 3, rec, log)
    for got, want in zip((*kr, *kl), (*tr, *tl), strict=True):
        assert torch.equal(got, want)
    if case == "not run":
        assert kr.q_ids[3].tolist() == [-1] * width and kr.q_probs[3].tolist() == [0.0] * width
        assert int(kr.drafts[3]) == 0 and int(kr.n_d[0]) == 2
    else:
        assert kr.q_ids[3].tolist() == out.ids[0].tolist()
        assert kr.q_probs[3].tolist() == out.probs[0].tolist()
        assert int(kr.drafts[3]) == {"too large": VOCAB - 1, "negative": 0}.get(case, 4321)
        assert int(kr.n_d[0]) == 3
    want_fault = {"too large": [CODE, 7, 3, VOCAB + 4], "negative": [CODE, 7, 3, -3],
                  "earlier fault": [2, 1, 0, 0]}.get(case, [0, 0, 0, 0])
    assert kl.fault.tolist() == want_fault
    others = [r for r in range(5) if r != 3]  # only row j is written
    assert (kr.q_ids[others] == -1).all() and (kr.drafts[others] == 0).all()


# --- broken variants: each planted bug changes a result the tests above compare ------------------
def _mutant_check(kind, logits, n_live, log, *, code, where):
    rows = torch.arange(logits.shape[0], device=logits.device)
    bad = ~torch.isfinite(logits).all(dim=1)
    if kind != "dead rows checked":
        bad = bad & (rows < n_live)
    cond = bad.any().reshape(1)
    if kind == "a fault over an earlier one":
        log.fault.copy_(torch.where(cond, torch.tensor([code, int(log.round_no[0]), where, 0],
                                                       device=logits.device), log.fault))
        return
    if kind == "the fault's round not recorded":
        log = FaultLog(log.fault, torch.zeros_like(log.round_no))
    record_fault_ref(log, cond, code, where, 0)


def _mutant_draft(out, one, j, rec, log, *, vocab, code):
    """the draft not clamped"""
    live = one > 0
    y = torch.where(live, out.tokens[:1], 0)
    record_fault_ref(log, live & ((y < 0) | (y >= vocab)), code, j, y)
    rec.q_ids[j] = torch.where(live, out.ids[0], -1)
    rec.q_probs[j] = torch.where(live, out.probs[0], 0.0)
    rec.drafts[j] = y[0]
    rec.n_d.add_(one)


@pytest.mark.parametrize("kind", ["a fault over an earlier one", "dead rows checked",
                                  "the fault's round not recorded"])
def test_broken_check_variants_differ(device, kind):
    x = _logits(device)
    x[3, 5] = float("nan")  # a dead row's NaN (n = 3) …
    x[1, 2] = float("nan")  # … and a live one's
    logs = [_log(device), _log(device, fault=(1, 4, 9, 0))]
    differ = 0
    for n, log in ((3, logs[0]), (3, logs[1]), (1, logs[0]), (2, logs[0])):
        y = x.clone()
        if n == 1:
            y[1, 2] = 0.0  # only the dead row's NaN is left
        k = _clone(log)
        check_logits(y, torch.tensor([n], dtype=torch.int32, device=device), k, code=CODE,
                     where=2)
        m = _clone(log)
        _mutant_check(kind, y, torch.tensor([n], dtype=torch.int32, device=device), m,
                      code=CODE, where=2)
        differ += not torch.equal(k.fault, m.fault)
    assert differ >= 1, kind


def test_broken_draft_variant_differs(device):
    out, rec, log = _sample(device, VOCAB + 4, 3), _record(device), _log(device)
    kr, kl = _clone(rec), _clone(log)
    record_draft(out, torch.ones(1, dtype=torch.int32, device=device), 3, kr, kl, vocab=VOCAB,
                 code=CODE)
    mr, ml = _clone(rec), _clone(log)
    _mutant_draft(out, torch.ones(1, dtype=torch.int32, device=device), 3, mr, ml, vocab=VOCAB,
                  code=CODE)
    assert not torch.equal(kr.drafts, mr.drafts)


# --- bad input ------------------------------------------------------------------------------------
def test_bad_input_names_the_argument(device):
    x, log = _logits(device), _log(device)
    n = torch.tensor([2], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="logits"):
        check_logits(x[:, ::2], n, log, code=CODE, where=0)
    with pytest.raises(ValueError, match="log.fault"):
        check_logits(x, n, FaultLog(log.fault.int(), log.round_no), code=CODE, where=0)
    with pytest.raises(ValueError, match="code"):
        check_logits(x, n, log, code=0, where=0)
    out, rec = _sample(device, 5, 3), _record(device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="j"):
        record_draft(out, one, 5, rec, log, vocab=VOCAB, code=CODE)
    with pytest.raises(ValueError, match="out.ids"):
        record_draft(out._replace(ids=out.ids[:, :2]), one, 0, rec, log, vocab=VOCAB, code=CODE)
    with pytest.raises(ValueError, match="rec.n_d"):
        record_draft(out, one, 0, rec._replace(n_d=rec.n_d.long()), log, vocab=VOCAB,
                     code=CODE)


@pytest.mark.gpu
def test_graph_replays_read_new_values(device):
    """Captured once, replayed with other device values: each replay records what those
    values say (the round graph's use)."""
    x, log = _logits(device), _log(device)
    n = torch.tensor([3], dtype=torch.int32, device=device)
    out, rec = _sample(device, 77, 3), _record(device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    check_logits(x, n, log, code=CODE, where=1)  # compile outside the capture
    record_draft(out, one, 2, rec, log, vocab=VOCAB, code=CODE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        check_logits(x, n, log, code=CODE, where=1)
        record_draft(out, one, 2, rec, log, vocab=VOCAB, code=CODE)
    log.fault.zero_()
    rec.n_d.zero_()
    out.tokens[0] = VOCAB + 1
    graph.replay()
    torch.cuda.synchronize()
    assert log.fault.tolist() == [CODE, 7, 2, VOCAB + 1] and int(rec.drafts[2]) == VOCAB - 1
    log.fault.zero_()
    x[2, 9] = float("nan")
    log.round_no.fill_(8)
    graph.replay()
    torch.cuda.synchronize()
    assert log.fault.tolist() == [CODE, 8, 1, 0] and int(rec.n_d[0]) == 2


# --- settle_round ---------------------------------------------------------------------------------
R, H, LOG, WIDTH = 4, 96, 3, 2  # rows, hidden, log rows (+ the dump row), served width


def _state(device, *, m=10, done=0, rnd=1, n_new=3, max_new=50, stop=(-2,), fault=(0, 0, 0, 0)
           ) -> RoundState:
    g = torch.Generator().manual_seed(5)
    i32 = dict(dtype=torch.int32, device=device)
    return RoundState(
        tokens=torch.arange(40, dtype=torch.int64).to(device),
        stop=torch.tensor(stop, dtype=torch.int64, device=device),
        m=torch.tensor([m], **i32), draft_next=torch.tensor([m - 1], **i32),
        hidden=torch.randn(R, H, generator=g).bfloat16().to(device),
        hidden_at=torch.tensor([m - 2], **i32), n_new=torch.tensor([n_new], **i32),
        max_new=torch.tensor([max_new], **i32), done=torch.tensor([done], **i32),
        round_no=torch.tensor([rnd], **i32),
        fault=torch.tensor(fault, dtype=torch.int64, device=device),
        head=torch.zeros(LOG + 1, 5, **i32),
        emitted=torch.full((LOG + 1, R), -1, dtype=torch.int64, device=device),
        drafts=torch.zeros(LOG + 1, R - 1, dtype=torch.int64, device=device),
        q_ids=torch.full((LOG + 1, R - 1, WIDTH), -1, dtype=torch.int64, device=device),
        q_probs=torch.zeros(LOG + 1, R - 1, WIDTH, dtype=torch.float32, device=device))


def _verify(device, a, token, bonus=0) -> VerifyOut:
    drafts = [21, 22, 23]
    em = drafts[:a] + [token] + [-1] * (R - 1 - a)
    i32 = dict(dtype=torch.int32, device=device)
    return VerifyOut(torch.tensor([a], **i32), torch.tensor([token], device=device),
                     torch.tensor([bonus], **i32), torch.tensor(em, device=device))


def _settle_both(device, v, s, keep_d=12):
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(R, H, generator=g).bfloat16().to(device)
    hidden[R - 1] = float("nan")  # a padding row: moved as bits
    rec = DraftRecord(torch.randint(0, 99, (R - 1, WIDTH), generator=g).to(device),
                      torch.rand(R - 1, WIDTH, generator=g).to(device),
                      torch.tensor([21, 22, 23], device=device),
                      torch.tensor([3], dtype=torch.int32, device=device))
    kd = torch.tensor([keep_d], dtype=torch.int32, device=device)
    ks, ts = _clone(s), _clone(s)
    settle_round(v, kd, hidden, rec, ks, vocab=VOCAB, code=CODE)
    settle_round_ref(v, kd, hidden, rec, ts, vocab=VOCAB, code=CODE)
    for name, got, want in zip(RoundState._fields, ks, ts, strict=True):
        assert torch.equal(got.view(torch.int16) if got.dtype == torch.bfloat16 else got,
                           want.view(torch.int16) if want.dtype == torch.bfloat16 else want), name
    return ks, hidden, rec


@pytest.mark.parametrize("a", [0, 1, 3])
def test_settle_round_commits_the_round(device, a):
    s = _state(device)
    ks, hidden, rec = _settle_both(device, _verify(device, a, 77, bonus=int(a == 3)), s)
    n = a + 1
    assert ks.tokens[11:11 + n].tolist() == [21, 22, 23][:a] + [77]
    assert ks.tokens[11 + n:39].tolist() == list(range(11 + n, 39))  # nothing else moved
    assert int(ks.tokens[39]) == (-1 if n < R else 39)  # the dump slot takes dead rows' −1
    assert ks.head[1].tolist() == [10, a, int(a == 3), 3, n]
    assert ks.emitted[1].tolist() == ([21, 22, 23][:a] + [77] + [-1] * R)[:R]
    assert ks.drafts[1].tolist() == [21, 22, 23]
    assert torch.equal(ks.q_ids[1], rec.q_ids) and torch.equal(ks.q_probs[1], rec.q_probs)
    assert (int(ks.m[0]), int(ks.n_new[0]), int(ks.round_no[0]), int(ks.done[0])) == (
        10 + n, 3 + n, 2, 0)
    assert (int(ks.draft_next[0]), int(ks.hidden_at[0])) == (12, 10)
    assert torch.equal(ks.hidden.view(torch.int16), hidden.view(torch.int16))
    assert ks.fault.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("case", ["stop id", "budget", "token fault", "earlier fault",
                                  "finished request"])
def test_settle_round_ends_the_request(device, case):
    s = _state(device, stop=(-2, 22) if case == "stop id" else (-2,),
               max_new=5 if case == "budget" else 50,
               fault=(1, 0, 4, 0) if case == "earlier fault" else (0, 0, 0, 0),
               done=1 if case == "finished request" else 0)
    token = VOCAB + 9 if case == "token fault" else 77
    before = _clone(s)
    ks, _, _ = _settle_both(device, _verify(device, 2, token), s)
    assert int(ks.done[0]) == 1
    if case == "token fault":
        assert ks.fault.tolist() == [CODE, 1, -1, VOCAB + 9]
    if case == "earlier fault":
        assert ks.fault.tolist() == [1, 0, 4, 0]
    if case == "finished request":  # nothing but the dump slot and the dump row moves
        for name in ("m", "n_new", "round_no", "draft_next", "hidden", "hidden_at", "fault"):
            assert torch.equal(getattr(ks, name), getattr(before, name)), name
        assert torch.equal(ks.tokens[:39], before.tokens[:39])
        assert torch.equal(ks.head[:LOG], before.head[:LOG])
        assert ks.head[LOG].tolist() == [10, 0, 0, 3, 0]
    else:
        assert int(ks.round_no[0]) == 2


def test_settle_round_names_bad_input(device):
    s, v = _state(device), _verify(device, 1, 5)
    rec = DraftRecord(torch.zeros(R - 1, WIDTH, dtype=torch.int64, device=device),
                      torch.zeros(R - 1, WIDTH, device=device),
                      torch.zeros(R - 1, dtype=torch.int64, device=device),
                      torch.zeros(1, dtype=torch.int32, device=device))
    kd = torch.tensor([3], dtype=torch.int32, device=device)
    hidden = torch.zeros(R, H, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="hidden"):
        settle_round(v, kd, hidden[:, :8], rec, s, vocab=VOCAB, code=CODE)
    with pytest.raises(ValueError, match="keep_d"):
        settle_round(v, kd.long(), hidden, rec, s, vocab=VOCAB, code=CODE)
    with pytest.raises(ValueError, match="rec.q_ids"):
        settle_round(v, kd, hidden, rec._replace(q_ids=rec.q_ids[:2]), s, vocab=VOCAB,
                     code=CODE)
    with pytest.raises(ValueError, match="s.m"):
        settle_round(v, kd, hidden, rec, s._replace(m=s.m.long()), vocab=VOCAB, code=CODE)


# --- compiled for the H200 ------------------------------------------------------------------------
def _compile_sm90() -> dict[str, int]:
    """Compile the four kernels for sm_90 (Triton's bundled ptxas, no GPU) → PTX lines each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.round_record as K

    types = {"x_ptr": "*fp32", "probs_ptr": "*fp32", "qp_ptr": "*fp32", "lqp_ptr": "*fp32",
             "hid_ptr": "*bf16", "sh_ptr": "*bf16", "fault_ptr": "*i64", "tok_ptr": "*i64",
             "ids_ptr": "*i64", "qi_ptr": "*i64", "d_ptr": "*i64", "next_ptr": "*i64",
             "vem_ptr": "*i64", "stop_ptr": "*i64", "lem_ptr": "*i64", "ldr_ptr": "*i64",
             "lqi_ptr": "*i64"}
    consts = {"BLOCK": K.BLOCK_V, "BLOCK_L": 128, "BLOCK_W": 32, "H": 3072, "BLOCK_R": 8,
              "BLOCK_HC": 512, "BLOCK_S": 4, "BLOCK_DB": 8, "BLOCK_DBW": 256, "PDL": False}
    out = {}
    for fn in (K._check_flags_kernel, K._check_logits_kernel, K._record_draft_kernel,
               K._settle_kernel):
        sig = {n: "constexpr" if n in consts else types.get(n, "*i32" if n.endswith("_ptr")
                                                              else "i32")
               for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs={n: consts[n] for n in fn.arg_names
                                                           if n in consts})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        out[fn.__name__] = k.asm["ptx"].count("\n")
    return out


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """The interpreter runs them above; the compiler types every branch (a constexpr flag left
    a runtime value, a select of mismatched types): compiled in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(lines) == {"_check_flags_kernel", "_check_logits_kernel",
                          "_record_draft_kernel", "_settle_kernel"}
    assert all(n > 20 for n in lines.values()), lines


if __name__ == "__main__":
    print(json.dumps(_compile_sm90()))
