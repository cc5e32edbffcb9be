"""NaN readiness and the ring of partial buffers (kernels/readiness.py) on the real tail kernels
(kernels/tails.py): proceed when all partials are there, fail after exactly max_polls when one
element never comes, permuted producers, stale values after a rotation, the protocol model
checked exhaustively against RingPolicy.safe, hypothesis-drawn schedules of produce / consume /
re-arm over several layers and rounds run on the kernels, and each unsafe policy's counterexample
(found by the model) replayed on the kernels, where it must break. GPU only: a consumer polling
while a producer on another stream writes late, and a producer that never writes.

Steps alternate attention tail (even t, with the folded router) and MoE tail (odd t); one round
is 2·LAYERS steps and n_live may change between rounds. N virtual ranks share one device; the
interpreter runs programs one after another, so concurrency is modelled as in ProtocolSim: the
producers' row writes interleave with whole consumer kernels in every order drawn.

Dimension letters: B buffers, N ranks, R rows, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.readiness import PartialRing, ProtocolSim, RingPolicy, explore
from kernels.tails import RouterScratch, attn_tail, moe_tail
from qualification.tolerances import check
from reference.twins.tails import attn_tail_ref, moe_tail_ref

# NaN partials are the point here; the interpreter's numpy warns about them
pytestmark = pytest.mark.filterwarnings("ignore:.*(invalid value|All-NaN):RuntimeWarning")

R, H, E, K = 4, 128, 16, 4
EPS, SCALE, FFN_SCALE = 1e-6, 0.75, 0.53881590608
LAYERS = 2


def grid_partials(gen, ranks: int, rows: int = R, hidden: int = H) -> torch.Tensor:
    """[N, R, H] on a 1/16 grid: exact sums in any order (see test_tails.py)."""
    return torch.randint(-24, 25, (ranks, rows, hidden), generator=gen).float() / 16


@dataclass
class World:
    """N virtual ranks on one device sharing a ring [B, N, R, H]; step inputs drawn per step."""

    policy: RingPolicy
    ranks: int
    device: torch.device
    max_polls: int = 3
    seed: int = 0
    log: list = field(default_factory=list)

    def __post_init__(self):
        gen = torch.Generator().manual_seed(self.seed)
        dev = self.device
        # the safe policy runs through PartialRing (the runtime's slot math); mutants bypass its
        # safety check with the same views over a plain tensor
        self.pring = (PartialRing(self.policy, self.ranks, R, H, device=dev)
                      if self.policy.safe else None)
        self.ring = (self.pring.buf if self.pring else
                     torch.full((self.policy.buffers, self.ranks, R, H), float("nan"), device=dev))
        self.sim = ProtocolSim(self.policy, self.ranks, R)
        self.norms = [(1 + 0.05 * torch.randn(H, generator=gen)).bfloat16().to(dev)
                      for _ in range(3)]
        self.router_w = (torch.randn(E, H, generator=gen) * 2 / H**0.5).to(dev)
        self.scratch = [RouterScratch.create(H, E, dev) for _ in range(self.ranks)]
        self.steps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def step_inputs(self, t: int):
        """(fresh partials [N, R, H], residual input [R, H] bf16) of step t, fixed per step."""
        if t not in self.steps:
            g = torch.Generator().manual_seed(1000 * self.seed + t)
            self.steps[t] = (grid_partials(g, self.ranks),
                             torch.randn(R, H, generator=g).bfloat16())
        return self.steps[t]

    def produce(self, q: int, t: int, n: int, rows=None) -> None:
        """Rank q's producer of step t writes `rows` (default: all n live rows)."""
        part, _ = self.step_inputs(t)
        pol, pr = self.policy, self.pring
        dst = pr.produce_view(t, q) if pr else self.ring[pol.read_slot(t), q]
        for r in range(n) if rows is None else rows:
            dst[r] = part[q, r].to(self.device)
            self.sim.produce(q, t, r)
            self.log.append(("produce", q, t, r))

    def consume(self, q: int, t: int, n: int):
        """Run rank q's consumer of step t on the real kernel → (outputs, twin, flag, polls)."""
        dev = self.device
        _, resid = self.step_inputs(t)
        if self.pring:
            part, rearm = self.pring.consume_view(t), self.pring.rearm_view(t, q)  # [N, R, H]
        else:
            pol = self.policy
            part, rearm = self.ring[pol.read_slot(t)], self.ring[pol.rearm_slot(t), q]
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        polls = torch.zeros(R, dtype=torch.int32, device=dev)
        n_live = torch.tensor([n], dtype=torch.int32, device=dev)
        fresh = self.step_inputs(t)[0].clone()
        kept = None if self.policy.rearm_all_rows else rearm[n:].clone()
        # the wrappers refuse a re-arm target inside the slot being read: lag-0 mutants re-arm
        # after the kernel (the same order the interpreter would run an in-kernel re-arm)
        lag0 = self.policy.rearm_slot(t) == self.policy.read_slot(t)
        late_rearm, rearm = (rearm, None) if lag0 else (None, rearm)
        if t % 2 == 0:
            out = attn_tail(part, resid.to(dev), self.norms[0], self.norms[1], n_live, flag,
                            eps=EPS, attn_out_scale=SCALE, max_polls=self.max_polls,
                            rearm=rearm, router_w=self.router_w, top_k=K,
                            scratch=self.scratch[q], polls=polls)
            twin = attn_tail_ref(fresh, resid, self.norms[0], self.norms[1], n, eps=EPS,
                                 attn_out_scale=SCALE, router_w=self.router_w, top_k=K)
        else:
            out = moe_tail(part, resid.to(dev), self.norms[2], n_live, flag, eps=EPS,
                           ffn_out_scale=FFN_SCALE, max_polls=self.max_polls, rearm=rearm,
                           polls=polls)
            twin = moe_tail_ref(fresh, resid, self.norms[2], n, eps=EPS,
                                ffn_out_scale=FFN_SCALE)
        if kept is not None:  # the mutant kernel: padding rows of the re-armed buffer untouched
            rearm[n:] = kept
        if late_rearm is not None and flag.item() == 0:
            late_rearm.fill_(float("nan"))
        if self.sim.ready(t, n):
            self.sim.consume(q, t, n)
        self.log.append(("consume", q, t, -1))
        return out, twin, int(flag.item()), polls.cpu()

    def assert_ring_matches_model(self) -> None:
        for (s, q, r), v in self.sim.state.items():
            nan = torch.isnan(self.ring[s, q, r]).cpu()
            assert nan.all() if v is None else not nan.any(), \
                f"slot {s} rank {q} row {r}: ring and model disagree (model: {v})"


def verify(out, twin, n: int) -> None:
    """Outputs of a consume equal the twin on the step's fresh partials."""
    if hasattr(out, "f_in"):
        check(out.h.cpu()[:n], twin.h, "kernels.residual_norm.exact", "bf16")
        check(out.f_in.cpu()[:n], twin.f_in, "kernels.residual_norm.attn_tail", "bf16")
        check(out.ids.cpu()[:n], twin.ids, "kernels.router.ids", "int32")
    else:
        check(out.xn.cpu()[:n], twin.xn, "kernels.residual_norm.moe_tail", "bf16")


# --- the protocol model --------------------------------------------------------------------

N_LIVE_STEPS = (3, 3, 1, 1, 3, 3)  # rounds of 2 steps: n_live 3, then 1, then 3 again


def test_policy_safety_matches_exhaustive_model():
    """Every (B, lag, re-arm extent) in a small grid: explore finds a violation iff the policy
    is unsafe, and the default is the smallest safe ring."""
    verdicts = {}
    for b, lag, all_rows in itertools.product(range(1, 5), range(0, 4), (True, False)):
        pol = RingPolicy(b, lag, all_rows)
        v = explore(pol, ranks=2, rows=3, n_live=N_LIVE_STEPS)
        assert (v is None) == pol.safe, (pol, v)
        verdicts[(b, lag, all_rows)] = "safe" if v is None else v.kind
    assert RingPolicy().safe and (RingPolicy().buffers, RingPolicy().lag) == (3, 1)
    assert not any(RingPolicy(b, 1).safe for b in (1, 2))
    assert verdicts[(3, 0, True)] == "stuck" and verdicts[(2, 1, True)] == "stale"
    assert verdicts[(3, 1, False)] == "stale"
    for ranks, rows, n_live in ((3, 2, (2, 2, 1, 1, 2, 2)), (2, 2, (1, 1, 2, 2, 1, 1, 2, 2))):
        for b, lag in itertools.product(range(1, 5), range(0, 3)):
            pol = RingPolicy(b, lag)
            assert (explore(pol, ranks, rows, n_live) is None) == pol.safe, (pol, ranks)
    print("\n", verdicts)


def test_empty_steps_need_a_synchronized_arm_before_the_next_live_step():
    """Steps with 0 live rows (rounds after a request's end, graph capture's warm-up) re-arm
    nothing: without an arm before the next live step a slot keeps an old step's values and is
    taken for fresh; with every rank arming at a barrier there, no interleaving goes wrong."""
    pol = RingPolicy()
    for n_live in ((2, 0, 1, 2, 1, 2), (1, 0, 0, 2, 1, 1, 2), (2, 2, 0, 1, 1, 2)):
        v = explore(pol, ranks=2, rows=2, n_live=n_live)
        assert v is not None and v.kind == "stale", (n_live, v)
        assert explore(pol, 2, 2, n_live, arm_after_empty=True) is None, n_live
    assert explore(pol, 2, 2, (0, 0, 2, 1, 2, 1)) is None  # empty steps first: armed anyway
    assert explore(pol, 3, 1, (1, 0, 0, 1, 1, 1), arm_after_empty=True) is None


# --- one consume on the kernels ------------------------------------------------------------


@pytest.mark.parametrize("bad_row", [0, 2])
@pytest.mark.parametrize("tail", ["attn", "moe"])
def test_unwritten_element_fails_after_exactly_max_polls(tail, bad_row, device):
    """One element of rank 1 never written: the flag is set after exactly max_polls polls of that
    row (and of the padding rows when the row is row 0, which they stand in for), its outputs are
    NaN (ids −1), the other rows are correct, and only ready row programs re-armed."""
    n, polls_bound = 3, 7
    w = World(RingPolicy(), ranks=2, device=device, max_polls=polls_bound, seed=3)
    t = 0 if tail == "attn" else 1
    for q in range(2):
        w.produce(q, t, n)
    w.ring[w.policy.read_slot(t), 1, bad_row, 77] = float("nan")
    rearm_slot = w.policy.rearm_slot(t)
    w.ring[rearm_slot, 0] = 5.0  # an old step's values, to be re-armed
    out, twin, flag, polls = w.consume(0, t, n)
    assert flag == 1
    failing = {bad_row} | (set(range(n, R)) if bad_row == 0 else set())
    for r in range(R):
        assert polls[r] == (polls_bound if r in failing else 1), (r, polls)
    ok_rows = [r for r in range(n) if r not in failing]
    rearmed = torch.isnan(w.ring[rearm_slot, 0]).all(-1).cpu()
    assert rearmed.tolist() == [r not in failing for r in range(R)]
    # the twin, with the same NaN, agrees on everything
    part = w.ring[w.policy.read_slot(t)].cpu()
    tflag = torch.zeros(1, dtype=torch.int32)
    tre = torch.full((R, H), 5.0)
    _, resid = w.step_inputs(t)
    if tail == "attn":
        tw = attn_tail_ref(part, resid, w.norms[0], w.norms[1], n, tflag, eps=EPS,
                           attn_out_scale=SCALE, rearm=tre, router_w=w.router_w, top_k=K)
        assert torch.isnan(out.h.cpu()[bad_row].float()).all()
        assert torch.isnan(out.f_in.cpu()[bad_row].float()).all()
        assert (out.ids.cpu()[bad_row] == -1).all()
        assert torch.isnan(out.weights.cpu()[bad_row]).all()
        for f in ("h", "f_in", "ids", "weights"):
            a, b = getattr(out, f).cpu()[:n], getattr(tw, f)
            assert torch.equal(a.isnan() if a.is_floating_point() else a,
                               b.isnan() if b.is_floating_point() else b), f
        verify(out_rows(out, ok_rows), out_rows(twin, ok_rows), len(ok_rows))
    else:
        tw = moe_tail_ref(part, resid, w.norms[2], n, tflag, eps=EPS, ffn_out_scale=FFN_SCALE,
                          rearm=tre)
        assert torch.isnan(out.xn.cpu()[bad_row].float()).all()
        assert torch.equal(out.xn.cpu()[:n].isnan(), tw.xn.isnan())
        verify(out_rows(out, ok_rows), out_rows(twin, ok_rows), len(ok_rows))
    assert tflag.item() == 1
    assert torch.equal(torch.isnan(tre).all(-1), rearmed)


def out_rows(o, rows: list[int]):
    """The same output object restricted to `rows` (for verify)."""
    idx = torch.tensor(rows, dtype=torch.long)
    cls = type(o)
    vals = {k: (None if v is None else v.cpu()[idx]) for k, v in vars(o).items()}
    return cls(**vals)


def test_permuted_producers_give_identical_bits(device):
    """Partials arriving in pieces, ranks and rows in a shuffled order, give the bits of an
    in-order write; before the last piece the consumer is not ready (flag, no outputs used)."""
    gen = torch.Generator().manual_seed(8)
    ranks, n = 3, 4
    part = torch.randn(ranks, R, H, generator=gen).to(device)  # sums depend on their order
    resid = torch.randn(R, H, generator=gen).bfloat16().to(device)
    norms = [(1 + 0.05 * torch.randn(H, generator=gen)).bfloat16().to(device) for _ in range(2)]
    rw = (torch.randn(E, H, generator=gen) * 2 / H**0.5).to(device)
    n_live = torch.tensor([n], dtype=torch.int32, device=device)

    def consume(buf, max_polls=2):
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        out = attn_tail(buf, resid, *norms, n_live, flag, eps=EPS, attn_out_scale=SCALE,
                        max_polls=max_polls, router_w=rw, top_k=K)
        return out, int(flag.item())

    ref, flag = consume(part.clone())
    assert flag == 0
    pieces = [(q, r, c) for q in range(ranks) for r in range(n) for c in (slice(0, 50),
                                                                           slice(50, H))]
    order = torch.randperm(len(pieces), generator=gen).tolist()
    buf = torch.full_like(part, float("nan"))
    for i, j in enumerate(order):
        q, r, c = pieces[j]
        buf[q, r, c] = part[q, r, c]
        if i in (0, len(order) // 2, len(order) - 2):
            assert consume(buf, max_polls=1)[1] == 1, f"ready after {i + 1} of {len(order)}"
    got, flag = consume(buf)
    assert flag == 0
    for f in ("h", "f_in", "ids", "weights"):
        a, b = getattr(got, f).cpu(), getattr(ref, f).cpu()
        assert torch.equal(a[:n].view(torch.int8), b[:n].view(torch.int8)), f


@pytest.mark.slow
def test_stale_values_of_a_previous_rotation_are_never_consumed(device):
    """Step 3 reuses step 0's slot, which consumer(1) re-armed. Producer(3) writes all but one
    element: the consumer meets the re-arm's NaN, fails at the bound, and succeeds with the fresh
    values once the element lands. Control: with that re-arm undone, the same partial write is
    consumed at once — with step 0's old element in it, and no flag."""
    n, late = 4, (1, 2, 5)  # rank, row, column of the late element
    for rearmed in (True, False):
        w = World(RingPolicy(), ranks=2, device=device, max_polls=3, seed=11)
        for t in range(3):
            for q in range(2):
                w.produce(q, t, n)
            for q in range(2):
                w.consume(q, t, n)
            if t == 1 and not rearmed:
                w.ring[w.policy.read_slot(0), :, :n] = w.step_inputs(0)[0][:, :n].to(device)
        slot = w.policy.read_slot(3)
        assert slot == w.policy.read_slot(0)
        fresh = w.step_inputs(3)[0].to(device)
        keep = w.ring[slot][late].clone()
        w.ring[slot, :, :n] = fresh[:, :n]
        w.ring[slot][late] = keep  # the late element: NaN if re-armed, else step 0's value
        out, twin, flag, _ = w.consume(0, 3, n)
        if rearmed:
            assert torch.isnan(keep) and flag == 1, "consumed a vector the re-arm left NaN"
            w.ring[slot][late] = fresh[late]
            out, twin, flag, _ = w.consume(0, 3, n)
            assert flag == 0
            verify(out, twin, n)
        else:
            assert flag == 0
            with pytest.raises(AssertionError):
                verify(out, twin, n)


# --- schedules over rotating buffers, layers and rounds --------------------------------------


def run_schedule(w: World, n_live: list[int], choose) -> None:
    """Interleave the ranks' streams, producers writing row by row; `choose(k)` picks one of k
    enabled ops. Every consume is checked against the twin on its step's fresh partials."""
    steps = len(n_live)
    pcs = [0] * w.ranks
    todo = [list(range(n_live[0])) for _ in range(w.ranks)]
    while any(pc < 2 * steps for pc in pcs):
        enabled = []
        for q in range(w.ranks):
            if pcs[q] < 2 * steps:
                t, is_consume = divmod(pcs[q], 2)
                if not is_consume:
                    enabled += [(q, r) for r in todo[q]]
                elif w.sim.ready(t, n_live[t]):
                    enabled.append((q, -1))
        assert enabled, f"stuck at {pcs}"
        q, row = enabled[choose(len(enabled))]
        t, is_consume = divmod(pcs[q], 2)
        if is_consume:
            out, twin, flag, polls = w.consume(q, t, n_live[t])
            assert flag == 0 and (polls == 1).all(), (w.log[-6:], flag, polls)
            verify(out, twin, n_live[t])
            pcs[q] += 1
            todo[q] = list(range(n_live[t + 1])) if t + 1 < steps else []
        else:
            w.produce(q, t, n_live[t], [row])
            todo[q].remove(row)
            pcs[q] += 0 if todo[q] else 1
    w.assert_ring_matches_model()


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), rounds=st.lists(st.integers(1, R), min_size=2, max_size=3),
       ranks=st.integers(2, 3))
@pytest.mark.slow
def test_schedules_on_real_kernels(data, rounds, ranks, device):
    n_live = [n for n in rounds for _ in range(2 * LAYERS)]
    w = World(RingPolicy(), ranks=ranks, device=device, max_polls=2, seed=len(n_live) + ranks)
    run_schedule(w, n_live, lambda k: data.draw(st.integers(0, k - 1)))


@pytest.mark.parametrize("policy", [RingPolicy(3, 0), RingPolicy(2, 1),
                                    RingPolicy(3, 1, rearm_all_rows=False)],
                         ids=["lag0", "B=lag+1", "live-rows-only"])
@pytest.mark.slow
def test_schedule_harness_catches_unsafe_policies(policy, device):
    """The harness of test_schedules_on_real_kernels is sensitive: with an unsafe policy some
    of a few seeded random schedules fail (stuck, flag, or wrong outputs)."""
    n_live = [n for n in (R, 1, R) for _ in range(2 * LAYERS)]
    for seed in range(6):
        rng = torch.Generator().manual_seed(seed)
        w = World(policy, ranks=2, device=device, max_polls=2, seed=seed)
        try:
            run_schedule(w, n_live, lambda k, g=rng: int(torch.randint(k, (1,), generator=g)))
        except AssertionError as err:
            print(f"\n  {policy}: schedule {seed} fails: {str(err)[:100]}")
            return
    pytest.fail(f"{policy}: no schedule failed")


@pytest.mark.parametrize("policy, kind", [
    (RingPolicy(3, 0), "stuck"),  # re-arms the buffer it just read
    (RingPolicy(2, 1), "stale"),  # re-arms the buffer the next producer writes next
    (RingPolicy(3, 1, rearm_all_rows=False), "stale"),  # padding rows keep old values
], ids=["lag0", "B=lag+1", "live-rows-only"])
def test_unsafe_policies_break_the_real_kernels(policy, kind, device):
    """The model's shortest counterexample, replayed op by op on the kernels, breaks them: a
    lost write ends in the failure flag, a stale read in silently wrong outputs."""
    n_live = (R, R, 1, 1, R, R)
    v = explore(policy, ranks=2, rows=R, n_live=n_live)
    assert v is not None and v.kind == kind, v
    w = World(policy, ranks=2, device=device, max_polls=3, seed=5)
    *head, last = v.trace if kind == "stale" else (*v.trace, None)
    for op, q, t, row in head:
        if op == "produce":
            w.produce(q, t, n_live[t], [row])
        else:
            out, twin, flag, _ = w.consume(q, t, n_live[t])
            assert flag == 0
            verify(out, twin, n_live[t])
    if kind == "stale":
        _, q, t, _ = last
        out, twin, flag, _ = w.consume(q, t, n_live[t])
        assert flag == 0, "a stale read looks ready"
        with pytest.raises(AssertionError):
            verify(out, twin, n_live[t])
    else:  # stuck: a waiting consumer never becomes ready; the kernel gives up at the bound
        done = {(q, t) for op, q, t, _ in v.trace if op == "consume"}
        q, t = next((q, t) for t in range(6) for q in range(2) if (q, t) not in done)
        _, _, flag, polls = w.consume(q, t, n_live[t])
        assert flag == 1 and polls.max() == 3
    print(f"\n  {v.kind} after {len(v.trace)} ops: {v.detail}")


# --- real concurrency (GPU) ------------------------------------------------------------------


def _gpu_scene(device, ranks=8, n=6, hidden=3072, experts=256, top_k=8):
    gen = torch.Generator().manual_seed(21)
    part = grid_partials(gen, ranks, 8, hidden).to(device)
    resid = torch.randn(8, hidden, generator=gen).bfloat16().to(device)
    norms = [(1 + 0.05 * torch.randn(hidden, generator=gen)).bfloat16().to(device)
             for _ in range(2)]
    rw = (torch.randn(experts, hidden, generator=gen) * 2 / hidden**0.5).to(device)
    return part, resid, norms, rw, torch.tensor([n], dtype=torch.int32, device=device)


@pytest.mark.gpu
def test_gpu_consumer_waits_for_a_late_producer(device):
    """Producer stream: a ~20 ms spin, then the partials land (rank by rank); consumer stream:
    launched right away, polls. It must wait (polls ≫ 1) and then give the bits of a consumer
    run on the finished buffer."""
    part, resid, norms, rw, n_live = _gpu_scene(device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    polls = torch.zeros(8, dtype=torch.int32, device=device)
    # The reference run uses the consumer's exact arguments, so it also JIT-compiles the very
    # specialization the race launches (Triton specializes max_polls == 1 and polls=None
    # differently); compiling inside the race takes longer than the producer's spin and
    # the consumer would then find the buffer already finished.
    ref = attn_tail(part, resid, *norms, n_live, flag, eps=EPS, attn_out_scale=1.0,
                    max_polls=2**30, router_w=rw, top_k=8, polls=polls)
    torch.cuda.synchronize()
    assert flag.item() == 0 and polls.max().item() == 1
    buf = torch.full_like(part, float("nan"))
    polls.zero_()
    prod, cons = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(prod):
        torch.cuda._sleep(40_000_000)
        for q in torch.randperm(8).tolist():
            buf[q].copy_(part[q])
    with torch.cuda.stream(cons):
        out = attn_tail(buf, resid, *norms, n_live, flag, eps=EPS, attn_out_scale=1.0,
                        max_polls=2**30, router_w=rw, top_k=8, polls=polls)
    torch.cuda.synchronize()
    assert flag.item() == 0
    n = int(n_live[0])
    assert polls[:n].min().item() > 10, f"the consumer did not wait: polls {polls.tolist()}"
    assert (polls[n:] == 0).all(), "padding rows (no re-arming) have nothing to wait for"
    for f in ("h", "f_in", "ids", "weights"):
        a, b = getattr(out, f)[:6].cpu(), getattr(ref, f)[:6].cpu()
        assert torch.equal(a.view(torch.int8), b.view(torch.int8)), f
    print(f"\n  polls while waiting: {polls.tolist()}")


@pytest.mark.gpu
def test_gpu_producer_never_writes(device):
    part, resid, norms, rw, n_live = _gpu_scene(device)
    buf = part.clone()
    buf[5, 3, 1000] = float("nan")  # rank 5 never writes this element of row 3
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    polls = torch.zeros(8, dtype=torch.int32, device=device)
    out = attn_tail(buf, resid, *norms, n_live, flag, eps=EPS, attn_out_scale=1.0,
                    max_polls=10_000, router_w=rw, top_k=8, polls=polls)
    torch.cuda.synchronize()
    assert flag.item() == 1 and polls[3].item() == 10_000
    assert torch.isnan(out.h[3].float()).all() and (out.ids[3] == -1).all()
    assert not torch.isnan(out.h[:3].float()).any()
    ring = PartialRing(RingPolicy(), 8, 8, 3072, device=device)
    ring.reset()  # what the engine does after a failure
    assert torch.isnan(ring.buf).all()


def test_an_empty_step_polls_rearms_and_flags_nothing(device):
    """n_live = 0 with re-arming (a round after the request's end, graph capture's warm-up): no
    program polls — the partials may all be NaN —, the re-arm target keeps its values, no flag;
    the same slot with one live row does wait, fail and leave the target alone (not ready)."""
    hidden, rows = 64, 4
    parts = torch.full((2, rows, hidden), float("nan"), device=device)
    h = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device)
    w = torch.ones(hidden, dtype=torch.bfloat16, device=device)
    for n, want_flag, want_polls in ((0, 0, 0), (1, 1, 3)):
        rearm = torch.full((1, rows, hidden), 7.0, device=device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        polls = torch.full((rows,), -1, dtype=torch.int32, device=device)
        moe_tail(parts, h, w, torch.tensor([n], dtype=torch.int32, device=device), flag,
                 eps=1e-6, ffn_out_scale=1.0, max_polls=3, rearm=rearm, polls=polls)
        assert flag.item() == want_flag, n
        assert (polls.cpu() == want_polls).all(), (n, polls)
        assert (rearm.cpu() == 7.0).all(), n
