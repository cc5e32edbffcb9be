"""Gate 4 — sliding-window rings at their boundaries: every live verification row attends
exactly its true window (window counts the current token), through writes, partial acceptance,
rollback and wrap, for the target ring (window + pad) and the draft ring (start position 1).

Visibility, not values: all keys are zero, so a row's attention is uniform over the keys it
reads and its output is the mean of their values. Values are random per position, so a set
that differs by one key moves the mean by ~|v|/W, far outside the BF16 output rounding. The
expected set comes from the positions alone (max(start, t−W+1) … t), independent of the ring's
slot arithmetic and labels. Rounds write R rows (1 … max_width) at the next positions, attend,
accept a random prefix and roll back the rest, for enough rounds to wrap the ring many times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RingCase:
    name: str
    window: int
    pad: int
    start: int  # first stored position (1 for the draft)


@dataclass(frozen=True)
class RingGateConfig:
    cases: tuple[RingCase, ...] = (
        RingCase("target ring (tiny: 16 + 8)", 16, 8, 0),
        RingCase("draft ring (tiny: 8 + 8)", 8, 8, 1),
    )
    max_width: int = 8
    rounds: int = 40
    heads: int = 6  # query heads of one KV head, as on one TP8 rank
    head_dim: int = 32
    seed: int = 4
    tol: float = 2e-2  # BF16 output of a mean of ≤ 16 BF16 values: ≤ 2^-8 relative + slack


def check_case(
    case: RingCase, g: RingGateConfig, dev, pad: int | None = None, window: int | None = None
):
    """(ok, evidence). pad / window override the ring built (negative controls); the expected
    windows always come from `case`."""
    from kernels.attention import attention
    from kernels.kv_cache import KVLayout, LayerKV, rollback, write_kv

    pad = case.pad if pad is None else pad
    built_window = case.window if window is None else window
    lay = KVLayout.make_ring(built_window, pad, 1, g.head_dim, start=case.start)
    cache = LayerKV.empty(lay, dev)
    gen = torch.Generator().manual_seed(g.seed)
    values = {}  # position → its value vector [D] (bf16 values as fp64)
    n, worst = case.start, 0.0
    for rnd in range(g.rounds):
        r = int(torch.randint(1, g.max_width + 1, (1,), generator=gen))
        pos = torch.arange(n, n + r)
        v = torch.randn(r, 1, g.head_dim, generator=gen).to(torch.bfloat16)
        for j, p in enumerate(pos.tolist()):
            values[p] = v[j, 0].double()
        k = torch.zeros(r, 1, g.head_dim, dtype=torch.bfloat16)
        p32 = pos.to(torch.int32).to(dev)
        write_kv(cache, k.to(dev), v.to(dev), p32, r)
        q = torch.zeros(r, g.heads, g.head_dim, dtype=torch.bfloat16, device=dev)
        try:
            out = attention(q, cache, p32, r, None, g.head_dim**-0.5).double().cpu()
        except ValueError as e:  # the wrapper refuses a ring too small for r rows
            return False, [f"{case.name}, pad {pad}: round {rnd} refused: {e}"]
        for j, t in enumerate(pos.tolist()):
            lo = max(case.start, t - case.window + 1)
            want = torch.stack([values[p] for p in range(lo, t + 1)]).mean(0)  # [D]
            err = float((out[j] - want).abs().max() / want.abs().max())
            worst = max(worst, err)
            if err > g.tol:
                return False, [f"{case.name}, pad {pad}: round {rnd}, row at position {t} "
                               f"did not attend exactly {lo}…{t} (rel err {err:.2e})"]
        a = int(torch.randint(0, r + 1, (1,), generator=gen))  # accepted prefix, then rollback
        keep = n + max(a, 1)  # the committed token of a round is always kept
        rollback(cache, keep, n + r)
        n = keep
    wraps = (n - case.start) / lay.capacity
    return True, [f"{case.name}: {g.rounds} rounds, {wraps:.1f} wraps of {lay.capacity} slots, "
                  f"worst rel err {worst:.1e} (tol {g.tol})"]


def gate_device() -> torch.device:
    """Compiled kernels on a GPU; on the CPU the interpreter (set by qualify)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run(g: RingGateConfig | None = None) -> tuple[bool, list[str]]:
    g = g or RingGateConfig()
    dev = gate_device()
    ok, evidence = True, []
    for case in g.cases:
        good, ev = check_case(case, g, dev)
        ok &= good
        evidence += ev
    return ok, evidence
