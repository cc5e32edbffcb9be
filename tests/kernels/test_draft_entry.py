"""kernels/draft_entry.py (the draft's entry launch) and its twin TwinOps.draft_entry, on depth-0-
and depth-j-like cases: clamps acting at both ends, out-of-range token ids, 0 live rows, strided
sources. Everything a live row must not read is NaN (embedding and hidden rows, token slots point
at NaN rows, eh padding), so a stray read shows as a non-finite output.

Oracle: the row geometry computed here in plain Python, then
  kernel  == kernels.rows.norm_rows on the oracle's gathered rows   (bit for bit: same helpers)
  twin    == reference.ops.rms_norm on them, row by row              (bit for bit)
  kernel vs twin under kernels.rows.norm bf16 (only the order of each sum of squares differs)
  positions of every row: exact.
DraftModel.forward_entry equals forward_rows fed today's gathered operands (round.py's
expressions) on the tiny correlated checkpoint: twins, and kernels under the interpreter.

Dimension letters: R rows, n live rows, P token slots, S hidden source rows, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from iquestrt.cache import RuntimeCaches
from iquestrt.config import RuntimeConfig
from iquestrt.engine import Engine
from iquestrt.ops import EntryNorms, EntrySource, KernelOps, Live, TwinOps
from iquestrt.weights import from_checkpoint
from kernels.draft_entry import draft_entry
from kernels.rows import norm_rows
from qualification.tolerances import check, measure, tolerance
from reference import ops as ref_ops
from reference.checkpoint import load_checkpoint
from reference.depth import FixedDepth
from tests.helpers.engine_setup import make_ckpt
from tests.kernels.sm90 import fusion_counts

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
V, H, R = 40, 200, 4  # H not a power of two: masked columns in the kernel's block
NAN = float("nan")


@dataclass(frozen=True)
class Case:
    name: str
    P: int  # token slots
    S: int  # hidden source rows
    tok_base: int
    tok_max: int
    hid_base: int
    pos_base: int
    n: int  # n_live as launched (may exceed R)
    bases: str = "tensor"  # "tensor": device [1] int32/int64 scalars; "int": host constants
    bad_token: int | None = None  # written into row 0's token slot (outside [0, V))
    strided: bool = False  # tokens_src / hid_src as strided views


CASES = [  # depth 0: tokens_src = st.tokens (slot P − 1 the dump slot), hid_src = st.hidden
    Case("d0_n1", P=12, S=R, tok_base=5, tok_max=11, hid_base=2, pos_base=5, n=1),
    Case("d0_n2_tok_clamp", P=12, S=R, tok_base=11, tok_max=11, hid_base=1, pos_base=11, n=2),
    Case("d0_n2_hid_low", P=12, S=R, tok_base=3, tok_max=11, hid_base=-1, pos_base=3, n=2,
         strided=True),
    Case("d0_n2_hid_high", P=12, S=R, tok_base=9, tok_max=10, hid_base=R - 1, pos_base=9, n=2,
         strided=True),
    Case("d0_bad_ids", P=12, S=R, tok_base=4, tok_max=11, hid_base=0, pos_base=4, n=2,
         bad_token=-1),
    Case("d0_bad_ids_high", P=12, S=R, tok_base=4, tok_max=11, hid_base=0, pos_base=4, n=1,
         bad_token=V + 7),
    Case("all_rows", P=12, S=R, tok_base=0, tok_max=11, hid_base=0, pos_base=0, n=R + 3),
    # depth j: tokens_src = d_buf [R − 1], tok_base = j − 1, hid_src = previous hidden [R, H]
    Case("dj_n1", P=R - 1, S=R, tok_base=1, tok_max=R - 2, hid_base=1, pos_base=17, n=1),
    Case("dj_n1_const", P=R - 1, S=R, tok_base=2, tok_max=R - 2, hid_base=0, pos_base=18, n=1,
         bases="int"),
    Case("dj_n0", P=R - 1, S=R, tok_base=0, tok_max=R - 2, hid_base=0, pos_base=19, n=0),
]


def _geometry(c: Case) -> tuple[list[int], list[int], int]:
    """Token slot and hidden row of each live row, and n = min(n_live, R): the launch's spec."""
    n = max(0, min(c.n, R))
    slots = [min(max(c.tok_base + r, 0), c.tok_max) for r in range(n)]
    hrows = [min(max(c.hid_base + r, 0), c.S - 1) for r in range(n)]
    return slots, hrows, n


def _inputs(c: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    slots, hrows, n = _geometry(c)
    # live tokens: distinct ids in [1, V − 2]; unread slots point at ids whose rows are NaN
    ids = (torch.randperm(V - 2, generator=g)[: c.P] + 1).tolist()
    tokens = torch.full((c.P,), V + 5, dtype=torch.int64)  # unread: clamps to V − 1 (NaN row)
    for s in set(slots):
        tokens[s] = ids[s]
    if c.bad_token is not None:
        tokens[slots[0]] = c.bad_token
    read_ids = {min(max(int(tokens[s]), 0), V - 1) for s in slots}
    embed = (torch.randn(V, H, generator=g) * 2).bfloat16()
    embed[[v for v in range(V) if v not in read_ids]] = NAN
    hid = (torch.randn(c.S, H, generator=g) * 3).bfloat16()
    hid[[s for s in range(c.S) if s not in hrows]] = NAN
    enorm = (1 + 0.3 * torch.randn(H, generator=g)).bfloat16()
    hnorm = (1 + 0.3 * torch.randn(H, generator=g)).bfloat16()
    if c.strided:  # every other slot / a column slice of a wider buffer
        wide = torch.full((2 * c.P,), -(10**6), dtype=torch.int64)
        wide[::2] = tokens
        tokens = wide[::2]
        hw = torch.full((c.S, 2 * H), NAN, dtype=torch.bfloat16)
        hw[:, H:] = hid
        hid = hw[:, H:]
    return tokens, hid, embed, enorm, hnorm


def _bases(c: Case, dev):
    if c.bases == "int":
        return c.tok_base, c.hid_base, c.pos_base
    return (torch.tensor([c.tok_base], dtype=torch.int32, device=dev),
            torch.tensor([c.hid_base], dtype=torch.int64, device=dev),  # `last` is int64 today
            torch.tensor([c.pos_base], dtype=torch.int32, device=dev))


def _poisoned(dev):
    return (torch.full((R, 2 * H), NAN, dtype=torch.bfloat16, device=dev),
            torch.full((R,), 12345, dtype=torch.int32, device=dev))


def _run_kernel(c: Case, tokens, hid, embed, enorm, hnorm):
    eh, pos = _poisoned(DEV)
    tb, hb, pb = _bases(c, DEV)
    n_live = torch.tensor([c.n], dtype=torch.int32, device=DEV)
    draft_entry(tokens.to(DEV), tb, c.tok_max, hid.to(DEV), hb, pb, n_live, embed.to(DEV),
                enorm.to(DEV), hnorm.to(DEV), EPS, eh, pos)
    return eh.cpu(), pos.cpu()


def _run_twin(c: Case, tokens, hid, embed, enorm, hnorm):
    eh, pos = _poisoned("cpu")
    tb, hb, pb = _bases(c, "cpu")
    TwinOps(torch.device("cpu"), 1).draft_entry(
        EntrySource(tokens, tb, c.tok_max, hid, hb, pb), Live.of(c.n, "cpu"),
        EntryNorms(embed, enorm, hnorm, EPS), eh, pos)
    return eh, pos


def _oracle(c: Case, tokens, hid, embed):
    """Gathered operands (e [n, H], hp [n, H]) and positions [R] from the plain-Python geometry."""
    slots, hrows, n = _geometry(c)
    ids = [min(max(int(tokens[s]), 0), V - 1) for s in slots]
    e, hp = embed[ids], hid[hrows]
    pos = torch.tensor([c.pos_base + r if r < n else -1 for r in range(R)], dtype=torch.int32)
    return e, hp, pos, n


def _rows_kernel_norm(x, w):
    """The row norm kernel on [n, H] (the composition the launch replaces, on the device)."""
    n = x.shape[0]
    live = torch.tensor([n], dtype=torch.int32, device=DEV)
    return norm_rows(x.to(DEV), w.to(DEV), live, EPS)[1].cpu()


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_entry_matches_rows_kernel_and_twin(c):
    tokens, hid, embed, enorm, hnorm = _inputs(c, 7 + len(c.name))
    e, hp, want_pos, n = _oracle(c, tokens, hid, embed)
    k_eh, k_pos = _run_kernel(c, tokens, hid, embed, enorm, hnorm)
    t_eh, t_pos = _run_twin(c, tokens, hid, embed, enorm, hnorm)
    assert torch.equal(k_pos, want_pos) and torch.equal(t_pos, want_pos), (k_pos, t_pos)
    for eh in (k_eh, t_eh):  # padding rows untouched (still the NaN poison)
        assert eh[n:].isnan().all()
    if n == 0:
        return
    assert torch.isfinite(k_eh[:n].float()).all() and torch.isfinite(t_eh[:n].float()).all()
    want_t = torch.cat([ref_ops.rms_norm(e, enorm, EPS), ref_ops.rms_norm(hp, hnorm, EPS)], 1)
    assert torch.equal(t_eh[:n], want_t)
    want_k = torch.cat([_rows_kernel_norm(e, enorm), _rows_kernel_norm(hp, hnorm)], 1)
    assert torch.equal(k_eh[:n], want_k)
    check(k_eh[:n], t_eh[:n], "kernels.rows.norm", "bf16")


def test_broken_variants_fail_the_same_comparisons():
    """hnorm on the embedding half, or a hidden row off by one, must fail both comparisons."""
    c = CASES[2]  # d0_n2_hid_low: two live rows
    tokens, hid, embed, enorm, hnorm = _inputs(c, 99)
    hid = hid.clone()
    hid[hid.isnan()] = 1.0  # the off-by-one variant reads a row the oracle does not use
    e, hp, _, n = _oracle(c, tokens, hid, embed)
    want_k = torch.cat([_rows_kernel_norm(e, enorm), _rows_kernel_norm(hp, hnorm)], 1)
    t_eh, _ = _run_twin(c, tokens, hid, embed, enorm, hnorm)
    tol = tolerance("kernels.rows.norm", "bf16")
    swapped, _ = _run_kernel(c, tokens, hid, embed, hnorm, hnorm)
    shifted, _ = _run_kernel(Case(**{**c.__dict__, "hid_base": c.hid_base + 2}),
                             tokens, hid, embed, enorm, hnorm)
    for bad in (swapped, shifted):
        assert not torch.equal(bad[:n], want_k)
        assert not measure(bad[:n], t_eh[:n], tol).ok


def test_kernel_ops_entry_equals_kernel():
    c = CASES[1]
    tokens, hid, embed, enorm, hnorm = _inputs(c, 5)
    k_eh, k_pos = _run_kernel(c, tokens, hid, embed, enorm, hnorm)
    eh, pos = _poisoned(DEV)
    tb, hb, pb = _bases(c, DEV)
    KernelOps(torch.device(DEV), 1).draft_entry(
        EntrySource(tokens.to(DEV), tb, c.tok_max, hid.to(DEV), hb, pb), Live.of(c.n, DEV),
        EntryNorms(embed.to(DEV), enorm.to(DEV), hnorm.to(DEV), EPS), eh, pos)
    assert torch.equal(eh.cpu()[: c.n], k_eh[: c.n]) and torch.equal(pos.cpu(), k_pos)


def _good_args():
    i32 = dict(dtype=torch.int32, device=DEV)
    return dict(tokens_src=torch.zeros(8, dtype=torch.int64, device=DEV),
                tok_base=torch.zeros(1, **i32), tok_max=7,
                hid_src=torch.zeros(R, H, dtype=torch.bfloat16, device=DEV),
                hid_base=torch.zeros(1, **i32), pos_base=torch.zeros(1, **i32),
                n_live=torch.ones(1, **i32),
                embed=torch.zeros(V, H, dtype=torch.bfloat16, device=DEV),
                enorm=torch.ones(H, dtype=torch.bfloat16, device=DEV),
                hnorm=torch.ones(H, dtype=torch.bfloat16, device=DEV), eps=EPS,
                eh_out=torch.empty(R, 2 * H, dtype=torch.bfloat16, device=DEV),
                pos_out=torch.empty(R, **i32))


BAD = [  # (argument, bad value, words the error must contain)
    ("tokens_src", lambda a: a["tokens_src"].int(), "tokens_src"),
    ("tok_max", lambda a: 8, "tok_max"),
    ("tok_max", lambda a: -1, "tok_max"),
    ("tok_base", lambda a: a["tok_base"].float(), "tok_base"),
    ("tok_base", lambda a: 1.5, "tok_base"),
    ("hid_base", lambda a: torch.zeros(2, dtype=torch.int64, device=DEV), "hid_base"),
    ("pos_base", lambda a: torch.zeros(1, dtype=torch.int16, device=DEV), "pos_base"),
    ("hid_src", lambda a: a["hid_src"].float(), "hid_src"),
    ("hid_src", lambda a: torch.zeros(R, H + 1, dtype=torch.bfloat16, device=DEV), "hid_src"),
    ("hid_src", lambda a: torch.zeros(H, R, dtype=torch.bfloat16, device=DEV).t(), "hid_src"),
    ("embed", lambda a: a["embed"].float(), "embed"),
    ("enorm", lambda a: torch.ones(H - 1, dtype=torch.bfloat16, device=DEV), "enorm"),
    ("hnorm", lambda a: torch.ones(2 * H, dtype=torch.bfloat16, device=DEV)[::2], "hnorm"),
    ("eh_out", lambda a: torch.empty(R, H, dtype=torch.bfloat16, device=DEV), "eh_out"),
    ("eh_out", lambda a: torch.empty(R, 2 * H, device=DEV), "eh_out"),
    ("pos_out", lambda a: torch.empty(R + 1, dtype=torch.int32, device=DEV), "pos_out"),
    ("pos_out", lambda a: torch.empty(R, dtype=torch.int64, device=DEV), "pos_out"),
    ("n_live", lambda a: torch.ones(1, dtype=torch.int64, device=DEV), "n_live"),
]


@pytest.mark.parametrize("arg,make,words", BAD, ids=[f"{b[0]}{i}" for i, b in enumerate(BAD)])
def test_bad_inputs_are_named(arg, make, words):
    args = _good_args()
    draft_entry(**args)  # the good call passes
    args[arg] = make(args)
    with pytest.raises(ValueError, match=words):
        draft_entry(**args)


# --- DraftModel.forward_entry vs forward_rows on today's gathered operands --------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return load_checkpoint(make_ckpt(tmp_path_factory.mktemp("corr"), "correlated"))


def _today_positions(start, n, ar):  # round.py's _positions
    return torch.where(ar < n, start + ar, -1).to(torch.int32)


def _same_cache(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.k, b.k), (a.v, b.v), (a.slot_pos, b.slot_pos)))


@pytest.mark.parametrize("ops", ["twins", "kernels"])
@pytest.mark.slow
def test_forward_entry_equals_forward_rows_on_gathered_operands(ckpt, ops):
    """A depth 0 with two catch-up rows then a depth 1, both ways, on two copies of a fresh draft
    cache: logits / hidden of live rows, positions and the cache bit for bit. State rows no live
    row reads (hidden rows, token slots past the catch-up) are NaN / −1."""
    dev = DEV if ops == "kernels" else "cpu"
    rcfg = RuntimeConfig(ops=ops, device=dev, ring_pad=8, max_positions=256,
                         policy=FixedDepth(3), sync_rounds=1)
    eng = Engine(from_checkpoint(ckpt, dev, 256), rcfg)
    cfg, draft, rows = eng.cfg, eng.draft, rcfg.max_width
    g = torch.Generator().manual_seed(11)
    P = 24  # token slots; slot P is the dump slot
    tokens = torch.zeros(P + 1, dtype=torch.int64)
    tokens[:3] = torch.randint(0, cfg.target.vocab_size, (3,), generator=g)
    tokens[P] = -1
    hidden = torch.full((rows, cfg.target.hidden_size), NAN, dtype=torch.bfloat16)
    hidden[:2] = torch.randn(2, cfg.target.hidden_size, generator=g).bfloat16()
    tokens, hidden = tokens.to(dev), hidden.to(dev)
    i32 = dict(dtype=torch.int32, device=dev)
    ar = torch.arange(rows, **i32)
    nxt, hidden_at, m = (torch.tensor([v], **i32) for v in (1, 0, 2))
    c = m - nxt + 1  # two catch-up rows
    one = torch.ones(1, **i32)
    caches = [RuntimeCaches.create(cfg, rcfg, 64, torch.device(dev)).draft for _ in range(2)]
    # depth 0, today: round.py RoundProgram.pre
    src = (nxt + ar).clamp(max=P).long()
    hrow = (nxt - 1 - hidden_at + ar).clamp(0, rows - 1).long()
    lo, ho = draft.forward_rows(tokens[src], hidden[hrow], _today_positions(nxt, c, ar),
                                Live.on_device(c), caches[0])
    ln, hn, pn = draft.forward_entry(tokens, nxt, P, hidden, nxt - 1 - hidden_at, nxt,
                                     Live.on_device(c), caches[1])
    assert torch.equal(pn, _today_positions(nxt, c, ar))
    assert torch.equal(ln[:2], lo[:2]) and torch.equal(hn[:2], ho[:2])
    assert torch.isfinite(ln[:2]).all() and _same_cache(*caches)
    # depth 1, today: round.py RoundProgram._steps
    d_buf = torch.zeros(rows - 1, dtype=torch.int64, device=dev)
    d_buf[0] = torch.argmax(ln[1])
    last = (c - 1).clamp(min=0).long()
    nxt = nxt + c
    toks = torch.zeros(rows, dtype=torch.int64, device=dev)
    toks[:1] = d_buf[0:1]
    hp = torch.zeros_like(ho)
    hp[:1] = ho.index_select(0, last)
    lo, ho = draft.forward_rows(toks, hp, _today_positions(nxt, one, ar), Live.on_device(one),
                                caches[0])
    ln, hn, pn = draft.forward_entry(d_buf, torch.zeros(1, **i32), rows - 2, hn, last, nxt,
                                     Live.on_device(one), caches[1])
    assert torch.equal(pn, _today_positions(nxt, one, ar))
    assert torch.equal(ln[:1], lo[:1]) and torch.equal(hn[:1], ho[:1])
    assert _same_cache(*caches)


SM90_ENTRY = dict(
    module="draft_entry", kernel="_draft_entry_kernel",
    sig=dict(tok_ptr="*i64", tok_base_ptr="*i32", hid_ptr="*bf16", hid_base_ptr="*i64",
             pos_base_ptr="*i32", n_live_ptr="*i32", embed_ptr="*bf16", enorm_ptr="*bf16",
             hnorm_ptr="*bf16", eh_ptr="*bf16", pos_ptr="*i32", eps="fp32"),
    const=dict(HIDDEN=3072, BLOCK_H=4096, TOK_PTR=True, HID_PTR=True, POS_PTR=True,
               PDL=False),
    patterns=(r"fma\.rn\.f32", r"div\.rn\.f32", r"sqrt\.rn\.f32", r"sqrt\.approx", r"rsqrt",
              r"ld\.global"))


@pytest.mark.slow
def test_entry_compiles_for_sm90_with_ieee_norms():
    """As launched (enable_fp_fusion=False): IEEE div.rn / sqrt.rn in both norms, no approximate
    sqrt, no FMA; the same kernel with fusion on contracts (so the FMA count can fail)."""
    off, on = fusion_counts(**SM90_ENTRY)
    got = {"False": off, "True": on}
    assert off["fma\\.rn\\.f32"] == 0 and on["fma\\.rn\\.f32"] > 0, got
    assert off["div\\.rn\\.f32"] >= 4 and off["sqrt\\.rn\\.f32"] >= 2, got
    assert off["sqrt\\.approx"] == off["rsqrt"] == 0 and off["ld\\.global"] > 0, got
