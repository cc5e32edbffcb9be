"""Shared by the TP tests and their spawned ranks: the sampling cases (inputs rebuilt from a
seed in every process), the one comparison all paths and broken variants go through, and a
spawner with a free TCP port and a bounded join. Imports no kernels module: a spawned rank must
set TRITON_INTERPRET before the first one (tp_workers.py does)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from reference.config import SamplingDefaults


@dataclass(frozen=True)
class Case:
    seed: int  # logits generator and sampling seed
    rows: int  # R
    live: int  # n <= R
    vocab: int  # V
    temperature: float
    top_k: int
    top_p: float
    ties: bool  # coarse 0.5 grid + the row maximum tied across a slice boundary
    seed_tensor: bool = False  # the sampling seed as an int64 tensor [1]

    @property
    def params(self) -> SamplingDefaults:
        return SamplingDefaults(self.temperature, self.top_k, self.top_p)


def cases(world: int) -> list[Case]:
    s = 100 * world
    return [
        Case(s + 1, 1, 1, 512, 0.0, 20, 1.0, True),
        Case(s + 2, 8, 8, 512, 1.0, 20, 0.95, True),
        Case(s + 3, 8, 8, 8192, 1.0, 20, 0.95, False),
        Case(s + 4, 4, 3, 8192, 0.7, 20, 1.0, True, seed_tensor=True),
        Case(s + 5, 5, 5, 512, 0.7, 1, 0.95, False),
        Case(s + 6, 2, 2, 8192, 0.0, 20, 0.95, True),
        Case(s + 7, 8, 8, 512, 1.0, 20, 1.0, True),
        Case(s + 8, 3, 3, 8192, 1.0, 1, 1.0, True),
    ]


# Broken variants run on these case indices: a sampled one and a greedy one whose maximum sits
# tied across the last slice boundary (a rank with offset 0 moves it to a low id).
BROKEN_CASES = (1, 5)


def logits(case: Case, world: int) -> torch.Tensor:
    """[R, V] fp32. With ties: a 0.5 grid (ties at the K-th place and in the top-p order span
    slices) and each row's maximum written at b − 1 and b for a slice boundary b."""
    g = torch.Generator().manual_seed(case.seed)
    x = torch.randn(case.rows, case.vocab, generator=g) * 2.0  # [R, V]
    if case.ties:
        x = torch.round(x * 2.0) / 2.0
        for r in range(case.rows):
            b = tie_boundary(case, world, r)
            x[r, b - 1 : b + 1] = x[r].max() + 1.0
    return x


def tie_boundary(case: Case, world: int, row: int) -> int:
    """The slice boundary b of a row's tied maximum (ids b − 1 and b; b − 1 wins the tie)."""
    vs = case.vocab // world
    return vs * (world - 1 - row % (world - 1)) if world > 1 else vs // 2


def sampling_args(case: Case):
    """(seed, positions [R]) of a case; positions differ per row and per case."""
    seed = (case.seed * 0x9E3779B97F4A7C15) % 2**64
    if case.seed_tensor:
        seed = torch.tensor([seed - 2**64 if seed >= 2**63 else seed], dtype=torch.int64)
    return seed, torch.arange(case.rows, dtype=torch.int64) * 3 + case.seed


def mismatch(got, want, n: int) -> list[str]:
    """Differences between two (tokens, ids, probs) results on the first n rows; [] when every
    entry is bit-identical."""
    out = []
    for name, a, b in zip(("tokens", "ids", "probs"), got, want, strict=True):
        a, b = a[:n].cpu(), b[:n].cpu()
        if a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"{name}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
        elif not torch.equal(a, b):
            rows = sorted({int(i) for i in torch.nonzero(a != b)[:, 0]})
            out.append(f"{name} differ in rows {rows}")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int, args: tuple, timeout_s: float) -> float:
    """Run fn(rank, *args) in `world` spawned processes; a child's exception fails the call,
    and children still running after timeout_s are killed (by pid) and reported. Seconds."""
    t0 = time.monotonic()
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    while not ctx.join(timeout=max(0.1, t0 + timeout_s - time.monotonic())):
        if time.monotonic() - t0 > timeout_s:
            alive = [p.pid for p in ctx.processes if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
            raise AssertionError(f"ranks with pids {alive} still running after {timeout_s} s")
    return time.monotonic() - t0


# --- the peer ring (tests/tp/test_tp_peer_ring.py) --------------------------------------------

RING_ROWS, RING_HIDDEN = 8, 256
RING_LIVE = (8, 5, 1, 8, 3, 6, 2, 8, 4)  # live rows at reduction steps 0, 1, …


def ring_partial(rank: int, step: int) -> torch.Tensor:
    """Rank `rank`'s partial of reduction step `step`: [R, H] fp32, the same in every process."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(RING_ROWS, RING_HIDDEN, generator=g)


def ring_tail_inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [R, H] bf16, norm weight [H] bf16) of the MoE tail consuming step `step`."""
    g = torch.Generator().manual_seed(7 + step)
    return (torch.randn(RING_ROWS, RING_HIDDEN, generator=g).bfloat16(),
            (1 + 0.1 * torch.randn(RING_HIDDEN, generator=g)).bfloat16())
