"""kernels/peer_partials.py: the tails reading N partial buffers at unrelated addresses through a
table give the bits of the same partials as one [N, R, H] tensor (attention tail with router and
quantization, MoE tail; fp32 and bf16 partials, strided rows); an unwritten peer buffer times
out into the failure flag; a table that misses a peer or a foreign buffer is caught; bad
buffers are named. On a GPU the same tests run compiled; across GPUs the buffers would be
peers' memory, which one device cannot show."""

from __future__ import annotations

import pytest
import torch

from kernels.peer_partials import PeerPartials
from kernels.tails import RouterScratch, attn_tail, moe_tail
from tests.kernels.test_tails import CASES, EPS, FFN_SCALE, Case, make_inputs, on

PICKED = [c for c in CASES if c.name in ("tiny-5of8-N2", "tiny-6of8-N4-bf16parts",
                                         "odd-7of7-N3-strided", "tiny-1of8-N8")]


def scattered(partials: torch.Tensor) -> PeerPartials:
    """Each partial [R, H] copied into its own allocation, allocated last-first with spacers
    between them (not where the [N, R, H] tensor would put them); row strides kept."""
    n, rows, _ = partials.shape
    keep, bufs = [], [None] * n
    for i in reversed(range(n)):
        keep.append(torch.empty(97 * (i + 1), dtype=torch.uint8, device=partials.device))
        b = torch.empty_strided((rows, partials.shape[2]), (partials.stride(1), 1),
                                dtype=partials.dtype, device=partials.device)
        b.copy_(partials[i])
        bufs[i] = b
    p = PeerPartials.of(bufs)
    step = partials.stride(0) * partials.element_size()
    assert n == 1 or any(b.data_ptr() - bufs[0].data_ptr() != i * step
                         for i, b in enumerate(bufs)), "laid out like the tensor: not scattered"
    return p


def run_both_tails(case: Case, d: dict, partials, device):
    """Attention tail (router, quantize, re-arm, polls) and MoE tail (x, quantize) → every output
    on the CPU, in a dict."""
    r, h = case.rows, case.hidden
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    polls = torch.zeros(r, dtype=torch.int32, device=device)
    rearm = torch.full((r, h), 5.0, dtype=case.part_dtype, device=device)
    scratch = RouterScratch.create(h, case.experts, device) if case.experts else None
    a = attn_tail(partials, d["xn"], d["attn_out_norm"], d["ffn_norm"], d["n_live"], flag,
                  eps=EPS, attn_out_scale=case.scale, max_polls=4, rearm=rearm,
                  router_w=d.get("router_w"), top_k=case.top_k, scratch=scratch, polls=polls,
                  quantize=True)
    out = {"h": a.h, "f_in": a.f_in, "fq": a.fq.view(torch.uint8), "sf": a.sf, "rearm": rearm,
           "attn polls": polls.clone()}
    if case.experts:
        out |= {"ids": a.ids, "weights": a.weights}
    m = moe_tail(partials, d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
                 ffn_out_scale=FFN_SCALE, max_polls=4, polls=polls, quantize=True)
    out |= {"xn": m.xn, "xq": m.xq.view(torch.uint8), "sx": m.sx, "moe polls": polls,
            "flag": flag}
    return {k: v.cpu() for k, v in out.items()}


def live(t: torch.Tensor, n: int) -> torch.Tensor:
    return t[:n] if t.dim() > 1 else t


@pytest.mark.parametrize("case", PICKED, ids=lambda c: c.name)
@pytest.mark.slow
def test_peer_buffers_give_the_bits_of_one_tensor(case, device):
    d = on(make_inputs(case, 300 + PICKED.index(case)), device, case.strided)
    want = run_both_tails(case, d, d["partials"], device)
    got = run_both_tails(case, d, scattered(d["partials"]), device)
    assert want["flag"].item() == 0 and (want["attn polls"] == 1).all()
    n = case.n_live
    for k, w in want.items():
        g = got[k]
        same = torch.equal(live(g, n).view(torch.uint8) if g.is_floating_point() else live(g, n),
                           live(w, n).view(torch.uint8) if w.is_floating_point() else live(w, n))
        assert same, f"{case.name}: {k} differs between peer buffers and one tensor"


def test_an_unwritten_peer_times_out(device):
    case = next(c for c in CASES if c.name == "tiny-5of8-N2")
    d = on(make_inputs(case, 7), device)
    parts = d["partials"].clone()
    parts[1] = float("nan")  # peer 1 never wrote this step
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    polls = torch.zeros(case.rows, dtype=torch.int32, device=device)
    m = moe_tail(scattered(parts), d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
                 ffn_out_scale=FFN_SCALE, max_polls=6, polls=polls)
    n = case.n_live
    assert flag.item() == 1
    assert polls.cpu()[:n].tolist() == [6] * n
    assert torch.isnan(m.xn.cpu()[:n].float()).all(), "a timed-out row must not look computed"


@pytest.mark.slow
def test_a_table_that_misses_a_peer_or_reads_a_foreign_buffer_is_caught(device):
    """Controls: the same tails through a table without peer N−1, or with peer 1's entry
    pointing at another (written) buffer, no longer match the one-tensor bits."""
    case = next(c for c in CASES if c.name == "tiny-6of8-N4-bf16parts")
    d = on(make_inputs(case, 11), device)
    want = run_both_tails(case, d, d["partials"], device)
    full = scattered(d["partials"])
    missing = PeerPartials.of(full.buffers[:-1])
    foreign = PeerPartials(full.buffers, full.table.clone())
    foreign.table[1] = full.buffers[0].data_ptr()
    for name, p in (("missing peer", missing), ("foreign buffer", foreign)):
        got = run_both_tails(case, d, p, device)
        assert not torch.equal(got["h"][: case.n_live].float(),
                               want["h"][: case.n_live].float()), f"{name}: h unchanged"


def test_bad_peer_buffers_are_named(device):
    f32 = lambda *s: torch.zeros(*s, device=device)  # noqa: E731
    with pytest.raises(ValueError, match="at least one buffer"):
        PeerPartials.of([])
    with pytest.raises(ValueError, match=r"buffers\[1\]: expected shape \(8, 128\)"):
        PeerPartials.of([f32(8, 128), f32(8, 64)])
    with pytest.raises(ValueError, match=r"buffers\[1\]: expected dtype"):
        PeerPartials.of([f32(8, 128), f32(8, 128).bfloat16()])
    with pytest.raises(ValueError, match=r"buffers\[1\]: expected unit column stride and row "
                                         r"stride 128"):
        PeerPartials.of([f32(8, 128), f32(8, 256)[:, :128]])
    with pytest.raises(ValueError, match=r"buffers\[0\]: expected dtype"):
        PeerPartials.of([f32(8, 128).half()])
    p = PeerPartials.of([f32(8, 128), f32(8, 128)])
    h = torch.zeros(8, 128, dtype=torch.bfloat16, device=device)
    w = torch.ones(128, dtype=torch.bfloat16, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    call = lambda parts, **kw: moe_tail(parts, h, w, None, flag, eps=EPS,  # noqa: E731
                                        ffn_out_scale=1.0, max_polls=1, **kw)
    with pytest.raises(ValueError, match="partials: expected a torch.Tensor or PeerPartials, "
                                         "got list"):
        call([f32(8, 128)])
    with pytest.raises(ValueError, match=r"PeerPartials.table: expected dtype"):
        call(PeerPartials(p.buffers, p.table.int()))
    with pytest.raises(ValueError, match="rearm: overlaps the partials being consumed"):
        call(p, rearm=p.buffers[1])
    with pytest.raises(ValueError, match="expected 1..64 partials"):
        call(PeerPartials.of([f32(8, 128)] * 65))


def test_rearm_of_a_ranks_split_k_partials(device):
    """A rank's slot holds its S split-K partials [S, R, H]: the consumer re-arms all S of them
    (every row), and leaves the slot it reads alone; a malformed re-arm target is named."""
    case = next(c for c in CASES if c.name == "tiny-5of8-N2")
    d = on(make_inputs(case, 21), device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    spare = torch.full((3, case.rows, case.hidden), 5.0, device=device)
    before = d["partials"].clone()
    moe_tail(scattered(d["partials"]), d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
             ffn_out_scale=FFN_SCALE, max_polls=4, rearm=spare)
    assert flag.item() == 0 and torch.isnan(spare.cpu()).all()
    assert torch.equal(d["partials"].cpu().nan_to_num(7.0), before.cpu().nan_to_num(7.0))
    with pytest.raises(ValueError, match=r"rearm\[0\]: expected unit column stride"):
        moe_tail(d["partials"], d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
                 ffn_out_scale=FFN_SCALE, max_polls=4,
                 rearm=torch.zeros(2, case.hidden, case.rows, device=device).transpose(1, 2))
    with pytest.raises(ValueError, match=r"rearm: expected a tensor \[R, H\] or \[S, R, H\]"):
        moe_tail(d["partials"], d["h"], d["next_norm"], d["n_live"], flag, eps=EPS,
                 ffn_out_scale=FFN_SCALE, max_polls=4, rearm=spare[None])
