"""Entry points of the spawned gloo ranks. Each sets TRITON_INTERPRET=1 before its first import
of a kernels module (this module imports none at top level) and writes what it saw to
<out_dir>/rank<r>.pt for the parent test to compare."""

from __future__ import annotations

import os
import time


def _setup():
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from tests.helpers import interpreter_speed

    torch.set_num_threads(1)
    interpreter_speed.install()


def sampling_worker(rank: int, world: int, port: int, out_dir: str, timeout_s: float) -> None:
    _setup()
    import torch
    from tp_harness import BROKEN_CASES, cases, logits, sampling_args

    from iquestrt.ops import Live
    from iquestrt.tp import group as tp_group
    from iquestrt.tp.sampling import gather_keys, make_sharded_sampler
    from kernels import sampler as k_sampler
    from reference.rng import Purpose

    g = tp_group.init_group(rank, world, master_addr="127.0.0.1", master_port=port,
                            backend="gloo", timeout_s=timeout_s)
    res = {"kernels": [], "twins": [], "keys_kernels": [], "keys_twins": [], "ref_kernels": {},
           "broken_offset": {}, "broken_rng": {},
           "env": {k: os.environ.get(k) for k, _ in tp_group.MULTICAST_OFF}}
    purpose = Purpose.TARGET_SAMPLE
    for i, case in enumerate(cases(world)):
        x = logits(case, world)  # [R, V]
        sh = g.vocab_slice(case.vocab)
        mine = x[:, sh.start : sh.stop].contiguous()  # [R, Vs]
        seed, pos = sampling_args(case)
        live = Live.of(case.live, "cpu")
        for ops in ("kernels", "twins"):
            smp = make_sharded_sampler(ops, g, case.vocab)
            res[ops].append(tuple(smp.sample(mine, case.params, seed, pos, purpose, live)))
            res[f"keys_{ops}"].append(
                smp.steps.local_keys(mine, case.params, sh.start, case.vocab, live))
        if i % world == rank:  # the single-process kernel result, one rank per case
            res["ref_kernels"][i] = tuple(k_sampler.sample(x, case.params, seed, pos, purpose,
                                                           n_live=live.t))
        if i in BROKEN_CASES:
            # The same public steps with one mistake each, through the same collective.
            smp = make_sharded_sampler("kernels", g, case.vocab)
            off = 0 if rank == world - 1 else sh.start  # the last rank forgets its offset
            keys = smp.steps.local_keys(mine, case.params, off, case.vocab, live)
            res["broken_offset"][i] = tuple(smp.steps.from_keys(
                gather_keys(g, keys), case.params, seed, pos, purpose, 0, case.vocab,
                live))
            keys = smp.steps.local_keys(mine, case.params, sh.start, case.vocab, live)
            rank_seed = (seed + rank) % 2**64  # uniforms keyed by rank (int seeds here)
            res["broken_rng"][i] = tuple(smp.steps.from_keys(
                gather_keys(g, keys), case.params, rank_seed, pos, purpose, 0,
                case.vocab, live))
    # Bad input on every rank: the named error comes before the collective, and the group
    # still works afterwards (no rank was left inside a half-started all-gather).
    case = cases(world)[1]
    smp = make_sharded_sampler("twins", g, case.vocab)
    seed, pos = sampling_args(case)
    x = logits(case, world)
    try:
        smp.sample(x, case.params, seed, pos, purpose, Live.of(case.live, "cpu"))
        res["bad_input"] = None
    except ValueError as e:
        res["bad_input"] = str(e)
    sh = g.vocab_slice(case.vocab)
    res["after_bad"] = tuple(smp.sample(x[:, sh.start : sh.stop].contiguous(), case.params, seed,
                                        pos, purpose, Live.of(case.live, "cpu")))
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    tp_group.close_group()


def failure_worker(rank: int, ports: tuple[int, int], out_dir: str, timeout_s: float,
                   gather_done) -> None:
    """Process 2 is rank 0 of a world of 2 whose rank 1 never joins: its init must fail within
    the bound. Processes 0 and 1 join a second group, and rank 1 never reaches the all-gather:
    rank 0's sample must fail within the bound. (Separate processes: a failed init leaves the
    process's group counter advanced, so a retry there would not meet its peer.)"""
    _setup()
    import torch

    from iquestrt.ops import Live
    from iquestrt.tp import group as tp_group
    from iquestrt.tp.sampling import make_sharded_sampler
    from reference.config import SamplingDefaults
    from reference.rng import Purpose

    def timed(fn):
        t0 = time.monotonic()
        try:
            fn()
            return None, time.monotonic() - t0
        except tp_group.TPError as e:
            return str(e), time.monotonic() - t0

    if rank == 2:
        res = timed(lambda: tp_group.init_group(0, 2, master_addr="127.0.0.1",
                                                master_port=ports[0], timeout_s=timeout_s,
                                                backend="gloo"))
        torch.save(res, os.path.join(out_dir, "init.pt"))
        return
    g = tp_group.init_group(rank, 2, master_addr="127.0.0.1", master_port=ports[1],
                            timeout_s=timeout_s, backend="gloo")
    if rank == 0:
        smp = make_sharded_sampler("twins", g, 64)
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
        res = timed(lambda: smp.sample(x, SamplingDefaults(), 1, torch.arange(2),
                                       Purpose.TARGET_SAMPLE, Live.of(2, "cpu")))
        torch.save(res, os.path.join(out_dir, "gather.pt"))
        gather_done.set()
    elif not gather_done.wait(60):
        raise RuntimeError("failure_worker: rank 0 never finished its all-gather")
    tp_group.close_group()


def model_worker(rank: int, world: int, port: int, out_dir: str, timeout_s: float, model: str,
                 tokens: list[int], broken: str, ops: str = "twins", reduce: str = "gather"
                 ) -> None:
    """A plain prefill of `tokens` through the rank's TPTargetModel (twins, chunks of 8 rows);
    saves this rank's view of the full logits [T, V] (all ranks' slices, gathered) and the
    routing of every MoE layer. broken: "" or "local_o" (each rank's attention tail sums only
    its own O partials: a reduction left out). reduce "peer": partials through the rings in
    shared files under out_dir (iquestrt/tp/peer_ring.py) instead of all-gathers."""
    _setup()
    import torch

    from iquestrt.cache import RuntimeCaches
    from iquestrt.config import RuntimeConfig
    from iquestrt.ops import make_ops
    from iquestrt.tp import group as tp_group
    from iquestrt.tp.model import TPTargetModel
    from iquestrt.tp.shard import shard_weights
    from iquestrt.weights import from_checkpoint
    from reference.checkpoint import load_checkpoint

    g = tp_group.init_group(rank, world, master_addr="127.0.0.1", master_port=port,
                            backend="gloo", timeout_s=timeout_s)
    ck = load_checkpoint(model)
    cap = len(tokens) + 8
    w, plans = shard_weights(from_checkpoint(ck, "cpu", cap), world, rank)
    rcfg = RuntimeConfig(ops=ops, ring_pad=8, max_positions=cap)
    rings = None
    if reduce == "peer":
        from iquestrt.tp.model import reduction_steps
        from iquestrt.tp.peer_ring import make_rings
        from kernels.linear import linear_fp8_splits

        rings = make_rings(g, 8, w.cfg.target.hidden_size,
                           linear_fp8_splits(*w.layers[0].attn.o.w.shape), 1 << 24,
                           *reduction_steps(w), out_dir)
    tm = TPTargetModel(w, plans, make_ops(ops, "cpu", rcfg.max_polls), 8, g, rings)
    if broken == "local_o":
        tm._gather = lambda x, what: x if x.dim() == 3 else x[None]  # this rank's partials only
    caches = RuntimeCaches.create(w.cfg, rcfg, cap, torch.device("cpu"))
    flags = torch.zeros(w.cfg.target.num_hidden_layers, dtype=torch.int32)
    tm.route_trace, logits = [], []
    for c in range(0, len(tokens), 8):
        chunk = torch.tensor(tokens[c : c + 8])
        lg, _ = tm.forward(chunk, c, caches, flags)
        logits.append(lg[: len(chunk)].clone())
    mine = torch.cat(logits)  # [T, V/N]
    full = tp_group.all_gather(g, mine, "model_worker", "logits").permute(1, 0, 2)
    torch.save({"logits": full.reshape(len(tokens), -1), "routes": tm.route_trace,
                "flags": flags}, os.path.join(out_dir, f"rank{rank}.pt"))
    tp_group.close_group()


def generate_worker(rank: int, world: int, port: int, out_dir: str, timeout_s: float,
                    model: str, prompt: list[int], max_new: int, sampling: tuple, seed: int
                    ) -> None:
    """One request through this rank's TPEngine (twins); saves tokens and round records."""
    _setup()
    import torch

    from iquestrt.config import RuntimeConfig
    from iquestrt.tp import group as tp_group
    from iquestrt.tp.engine import TPEngine
    from iquestrt.weights import from_checkpoint
    from reference.checkpoint import load_checkpoint
    from reference.config import SamplingDefaults
    from reference.depth import FixedDepth
    from reference.speculative import GenerationRequest

    g = tp_group.init_group(rank, world, master_addr="127.0.0.1", master_port=port,
                            backend="gloo", timeout_s=timeout_s)
    ck = load_checkpoint(model)
    cap = len(prompt) + max_new + 16
    rcfg = RuntimeConfig(ops="twins", ring_pad=8, max_positions=cap, policy=FixedDepth(3),
                         prefetch=False)
    eng = TPEngine(from_checkpoint(ck, "cpu", cap), rcfg, g)
    res = eng.generate(GenerationRequest(tuple(prompt), max_new, SamplingDefaults(*sampling),
                                         seed))
    rounds = [(r.position, [d.token for d in r.drafts], r.accepted, r.emitted)
              for r in res.rounds]
    torch.save({"tokens": res.tokens, "rounds": rounds}, os.path.join(out_dir, f"rank{rank}.pt"))
    tp_group.close_group()


def peer_ring_worker(rank: int, world: int, port: int, out_dir: str, timeout_s: float) -> None:
    """One NCCL rank on its own GPU (compiled kernels): the ring in symmetric memory, every step
    produced into this rank's slot and consumed by the MoE tail reading all ranks' slots; the
    same tail on the stacked partials of every rank (rebuilt here) is the expected bits."""
    import torch
    from tp_harness import RING_HIDDEN, RING_LIVE, RING_ROWS, ring_partial, ring_tail_inputs

    from iquestrt.tp import group as tp_group
    from iquestrt.tp.peer_ring import symmetric_ring
    from kernels.tails import moe_tail

    g = tp_group.init_group(rank, world, master_addr="127.0.0.1", master_port=port,
                            backend="nccl", timeout_s=timeout_s)
    dev = g.device
    ring = symmetric_ring(g, RING_ROWS, RING_HIDDEN)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    res = {"got": [], "want": [], "polls": []}
    for t, n in enumerate(RING_LIVE):
        ring.produce(t)[0, :n] = ring_partial(rank, t)[:n].to(dev)
        h, w = (x.to(dev) for x in ring_tail_inputs(t))
        n_live = torch.tensor([n], dtype=torch.int32, device=dev)
        polls = torch.zeros(RING_ROWS, dtype=torch.int32, device=dev)
        got = moe_tail(ring.consume(t), h, w, n_live, flag, eps=1e-6, ffn_out_scale=0.5,
                       max_polls=1 << 22, rearm=ring.rearm(t), polls=polls)
        stacked = torch.stack([ring_partial(p, t) for p in range(world)]).to(dev)
        want = moe_tail(stacked, h, w, n_live, flag, eps=1e-6, ffn_out_scale=0.5, max_polls=1)
        res["got"].append(got.xn[:n].cpu())
        res["want"].append(want.xn[:n].cpu())
        res["polls"].append(polls.cpu())
    torch.cuda.synchronize(dev)
    res["flag"] = int(flag.item())
    torch.save(res, f"{out_dir}/rank{rank}.pt")
    tp_group.close_group()


def shared_ring_worker(rank: int, world: int, port: int, out_dir: str, timeout_s: float,
                       silent_step: int) -> None:
    """One gloo rank (interpreted kernels) on the shared-file ring: before producing each step it
    sleeps a rank- and step-dependent time (producers and consumers of different ranks overlap
    in every order); rank world − 1 never produces step `silent_step` (−1: it always does), so
    the consumers of that step must end in the failure flag within their bound."""
    _setup()
    import random

    import torch
    from tp_harness import RING_HIDDEN, RING_LIVE, RING_ROWS, ring_partial, ring_tail_inputs

    from iquestrt.tp import group as tp_group
    from iquestrt.tp.peer_ring import shared_file_ring
    from kernels.tails import moe_tail

    g = tp_group.init_group(rank, world, master_addr="127.0.0.1", master_port=port,
                            backend="gloo", timeout_s=timeout_s)
    ring = shared_file_ring(g, RING_ROWS, RING_HIDDEN, out_dir)
    delay = random.Random(rank)
    res = {"got": [], "want": [], "flags": [], "polls": []}
    steps = len(RING_LIVE) if silent_step < 0 else silent_step + 1
    for t in range(steps):
        n = RING_LIVE[t]
        time.sleep(delay.uniform(0.0, 0.05))
        if (rank, t) != (world - 1, silent_step):
            ring.produce(t)[0, :n] = ring_partial(rank, t)[:n]
        h, w = ring_tail_inputs(t)
        flag = torch.zeros(1, dtype=torch.int32)
        polls = torch.zeros(RING_ROWS, dtype=torch.int32)
        got = moe_tail(ring.consume(t), h, w, torch.tensor([n], dtype=torch.int32), flag,
                       eps=1e-6, ffn_out_scale=0.5, max_polls=20000 if t != silent_step else 50,
                       rearm=ring.rearm(t), polls=polls)
        stacked = torch.stack([ring_partial(p, t) for p in range(world)])
        want = moe_tail(stacked, h, w, torch.tensor([n], dtype=torch.int32),
                        torch.zeros(1, dtype=torch.int32), eps=1e-6, ffn_out_scale=0.5,
                        max_polls=1)
        res["got"].append(got.xn[:n].clone())
        res["want"].append(want.xn[:n].clone())
        res["flags"].append(int(flag.item()))
        res["polls"].append(polls.clone())
    torch.save(res, f"{out_dir}/rank{rank}.pt")
    g_done = torch.zeros(1)
    torch.distributed.all_reduce(g_done)  # nobody unmaps its ring while a peer still reads it
    tp_group.close_group()


def engine_rings_worker(rank: int, world: int, port: int, out_dir: str, timeout_s: float,
                        model: str) -> None:
    """A TPEngine with tp_reduce "peer" (interpreted kernels): its rings (a directory rank 0
    made, shared by both), the O ring's partials per rank, and one target forward through them;
    saves what it saw."""
    _setup()
    import torch

    from iquestrt.config import RuntimeConfig
    from iquestrt.tp import group as tp_group
    from iquestrt.tp.engine import TPEngine
    from iquestrt.weights import from_checkpoint
    from reference.checkpoint import load_checkpoint

    g = tp_group.init_group(rank, world, master_addr="127.0.0.1", master_port=port,
                            backend="gloo", timeout_s=timeout_s)
    rcfg = RuntimeConfig(ops="kernels", ring_pad=8, max_positions=32, tp_reduce="peer",
                         prefetch=False)
    eng = TPEngine(from_checkpoint(load_checkpoint(model), "cpu", 32), rcfg, g)
    rings = eng.target.rings
    caches, flags = eng._request_caches()
    logits, _ = eng.target.forward(torch.tensor([3, 1, 4, 1, 5]), 0, caches, flags)
    from iquestrt.ops import Live

    o = eng.target.w.layers[0].attn.o
    made = eng.ops.linear_fp8_partials(torch.zeros(8, o.w.shape[1], dtype=torch.bfloat16), o,
                                       Live.of(1, "cpu")).shape[0]  # the partials it produces
    steps = (rings.o_step, rings.moe_step)
    written = bool(torch.isfinite(rings.o.views[rank]).any())
    eng.ring_resets.reset()  # collective: what each request's start (and a graphed decode) does
    armed = all(bool(torch.isnan(r.views[rank]).all()) for r in (rings.o, rings.moe))
    torch.save({"o_parts": rings.o.views[0].shape[1], "made": made, "steps": steps,
                "buffers": (rings.o.policy.buffers, rings.moe.policy.buffers),
                "written": written, "armed": armed, "after_reset": (rings.o_step, rings.moe_step),
                "flags": flags.clone(), "logits": logits[:5].clone(),
                "directory": rings.directory, "files": sorted(os.listdir(rings.directory))},
               f"{out_dir}/rank{rank}.pt")
    tp_group.close_group()


def graphs_worker(rank: int, world: int, port: int, out_dir: str, timeout_s: float,
                  reduce: str) -> None:
    """One NCCL rank on its own GPU (compiled kernels, the mini model): two requests each with
    one CUDA graph per round and with eager launches, the log read every 4 rounds (rounds with
    0 live rows run after each request's end); saves every request's tokens and rounds."""
    import torch

    from iquestrt.config import RuntimeConfig
    from iquestrt.tp import group as tp_group
    from iquestrt.tp.engine import TPEngine
    from iquestrt.weights import from_checkpoint
    from qualification import mini_engine
    from reference.checkpoint import load_checkpoint
    from reference.config import SamplingDefaults
    from reference.depth import FixedDepth
    from reference.speculative import GenerationRequest

    g = tp_group.init_group(rank, world, master_addr="127.0.0.1", master_port=port,
                            backend="nccl", timeout_s=timeout_s)
    ck = load_checkpoint(mini_engine.MINI)
    prompts = [p.ids[-48:] for p in mini_engine.prompts(48)[:2]]
    out = {}
    for graphs in (True, False):
        rcfg = RuntimeConfig(ops="kernels", device=str(g.device), ring_pad=8, max_positions=160,
                             policy=FixedDepth(3), prefetch=False, graphs=graphs, sync_rounds=4,
                             tp_reduce=reduce)
        eng = TPEngine(from_checkpoint(ck, str(g.device), 160), rcfg, g)
        for i, prompt in enumerate(prompts):
            res = eng.generate(GenerationRequest(tuple(prompt), 40,
                                                 SamplingDefaults(1.0, 20, 0.95), 5 + i))
            out[graphs, i] = (res.tokens, [(r.accepted, [d.token for d in r.drafts])
                                           for r in res.rounds])
        eng.close()
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    tp_group.close_group()


def bench_round_worker(rank: int, world: int, port: int, out_dir: str, timeout_s: float) -> None:
    """`bench round --tp` at a small rank on gloo ranks (interpreted kernels, the ring in shared
    files): one configuration; saves the record's TP part, configurations and tokens."""
    _setup()
    import torch

    from benchmarks.rank.shapes import small_rank_config
    from benchmarks.rank.spec import SweepSpec
    from benchmarks.rank.sweep import Rig, run_sweep
    from iquestrt.tp import group as tp_group

    g = tp_group.init_group(rank, world, master_addr="127.0.0.1", master_port=port,
                            backend="gloo", timeout_s=timeout_s)
    spec = SweepSpec(widths=(4,), adaptive=False, contexts=("1K",), rounds=4, reps=1,
                     baseline="none", profile="none", eager=False, reduce="ring", tp=world)
    # the mini traces' 24 experts and top-4 (one rank expert per mini expert): half the default's
    # MoE programs, the interpreter's largest cost here
    cfg = small_rank_config(experts=24, top_k=4)
    rec = run_sweep(spec, os.path.join(out_dir, "rec"), "test",
                    Rig(cfg, "cpu", "kernels", 4.24e12), g)
    torch.save({"tp": rec["tp"], "configs": rec["configs"]}, f"{out_dir}/rank{rank}.pt")
    tp_group.close_group()
