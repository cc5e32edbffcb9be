"""Entry points of the spawned gloo ranks. Each sets TRITON_INTERPRET=1 before its first import
of a kernels module (this module imports none at top level) and writes what it saw to
<out_dir>/rank<r>.pt for the parent test to compare."""

from __future__ import annotations

import os
import time


def _setup():
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch.set_num_threads(1)


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
