"""reference/rng.py: Philox4x32-10 bits (Random123 vectors, a Python-int twin, Triton's own
tl.philox under the interpreter) and the statistical sanity of the uniforms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from scipy import stats

from reference.rng import Purpose, RngError, philox4x32, random_words, uniforms

ALPHA = 1e-3  # per statistical check; inputs are fixed, so each outcome is deterministic
MASK = 0xFFFFFFFF

# Random123 tests/kat_vectors, the three `philox4x32 10` lines: ctr[4], key[2] -> out[4].
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK,) * 4, (MASK, MASK), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def philox_py(ctr: tuple[int, ...], key: tuple[int, int], rounds: int = 10) -> list[int]:
    """Philox4x32 on Python integers, written from the Random123 description."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
        k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
    return [c0, c1, c2, c3]


def _words(ctr):
    return tuple(torch.tensor([w], dtype=torch.int64) for w in ctr)


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_known_answer_vectors(ctr, key, expected):
    assert [int(w) for w in philox4x32(_words(ctr), key)] == list(expected)
    assert philox_py(ctr, key) == list(expected)


def test_known_answer_vectors_fail_with_a_broken_round():
    # A 9-round Philox or swapped multipliers must not pass the vectors.
    ctr, key, expected = KAT[2]
    assert [int(w) for w in philox4x32(_words(ctr), key, rounds=9)] != list(expected)
    assert philox_py((ctr[2], ctr[1], ctr[0], ctr[3]), key) != list(expected)


def test_matches_python_int_twin_on_edge_and_random_counters():
    g = torch.Generator().manual_seed(11)
    edge = torch.tensor([0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, MASK], dtype=torch.int64)
    rand = torch.randint(0, 2**32, (4, 64), generator=g, dtype=torch.int64)
    ctr = [torch.cat([edge.roll(i), rand[i]]) for i in range(4)]  # 4 x [71]
    for key in [(0, 0), (MASK, 1), (0x12345678, 0x9ABCDEF0)]:
        got = torch.stack(philox4x32(tuple(ctr), key), 1)  # [71, 4]
        for n in range(got.shape[0]):
            assert got[n].tolist() == philox_py(tuple(int(c[n]) for c in ctr), key)


def test_uniforms_are_the_top_24_bits_of_word_0():
    seed, pos = 0xDEADBEEFCAFEF00D, torch.arange(1000, 2000, dtype=torch.int64)
    u = uniforms(seed, pos, Purpose.ACCEPT, index=3)
    assert u.dtype == torch.float32 and u.shape == (1000,)
    assert bool((u >= 0).all() and (u < 1).all())
    k = u.double() * 2**24
    assert torch.equal(k, k.round())  # exactly on the 2^-24 grid
    key = (seed & MASK, seed >> 32)
    for n in (0, 1, 500, 999):
        x = philox_py((1000 + n, int(Purpose.ACCEPT), 3, 0), key)[0]
        assert int(k[n]) == x >> 8


def test_deterministic_and_batch_invariant():
    pos = torch.tensor([5, 3, 2**32 - 1, 0], dtype=torch.int64)
    a = uniforms(42, pos, Purpose.DRAFT_SAMPLE, 1)
    assert torch.equal(a, uniforms(42, pos, Purpose.DRAFT_SAMPLE, 1))
    for i in range(4):
        assert torch.equal(a[i : i + 1], uniforms(42, pos[i : i + 1], Purpose.DRAFT_SAMPLE, 1))


def test_every_counter_component_changes_the_stream():
    seeds = [0, 1, 2**32, 2**63, 2**64 - 1]
    pos = torch.arange(0, 64, dtype=torch.int64)
    seen = {}
    for s in seeds:
        for pu in Purpose:
            for idx in (0, 1, 7):
                w = torch.stack(random_words(s, pos, pu, idx), 1)  # [64, 4]
                for n in range(64):
                    seen.setdefault(tuple(w[n].tolist()), []).append((s, n, pu, idx))
    assert len(seen) == len(seeds) * len(Purpose) * 3 * 64, "two counters gave identical words"


def _ks_p(u: torch.Tensor) -> float:
    return stats.kstest(u.double().numpy(), "uniform").pvalue


def _independence_p(a: torch.Tensor, b: torch.Tensor, bins: int = 16) -> float:
    cell = (a * bins).long() * bins + (b * bins).long()  # [N]
    obs = torch.bincount(cell, minlength=bins * bins).double().numpy()
    return stats.chisquare(obs).pvalue  # uniform expected counts


@pytest.mark.slow
def test_uniformity_and_stream_independence():
    pos = torch.arange(2**16, dtype=torch.int64)
    u_acc = uniforms(2024, pos, Purpose.ACCEPT)
    u_tgt = uniforms(2024, pos, Purpose.TARGET_SAMPLE)
    across_seeds = torch.cat([uniforms(s, torch.tensor([77]), Purpose.ACCEPT) for s in range(2000)])
    assert _ks_p(u_acc) > ALPHA
    assert _ks_p(u_tgt) > ALPHA
    assert _ks_p(across_seeds) > ALPHA
    assert _independence_p(u_acc, u_tgt) > ALPHA
    # Sensitivity: a skewed transform and one shared stream for two purposes must fail.
    assert _ks_p(u_acc.pow(1.05)) < ALPHA
    assert _independence_p(u_acc, u_acc) < ALPHA


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(seed=1.0), "seed"),
        (dict(seed=True), "seed"),
        (dict(positions=torch.tensor([-1])), "positions"),
        (dict(positions=torch.tensor([2**32])), "positions"),
        (dict(positions=torch.tensor([1], dtype=torch.int32)), "int64"),
        (dict(positions=torch.zeros(2, 2, dtype=torch.int64)), "1-D"),
        (dict(purpose=7), "purpose"),
        (dict(index=-1), "index"),
        (dict(index=2**32), "index"),
    ],
)
def test_bad_inputs_raise_named_errors(kwargs, match):
    args = dict(seed=1, positions=torch.tensor([0]), purpose=Purpose.ACCEPT, index=0) | kwargs
    with pytest.raises(RngError, match=match):
        uniforms(**args)


_TRITON_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    @triton.jit
    def _words_kernel(out_ptr, u_ptr, rint_ptr, pos_ptr, seed, purpose, index, N: tl.constexpr):
        offs = tl.arange(0, N)
        pos = tl.load(pos_ptr + offs).to(tl.uint32)
        zero = pos * 0
        a, b, c, d = tl.philox(seed, pos, zero + purpose.to(tl.uint32),
                               zero + index.to(tl.uint32), zero)
        tl.store(out_ptr + offs * 4 + 0, a.to(tl.int32, bitcast=True))
        tl.store(out_ptr + offs * 4 + 1, b.to(tl.int32, bitcast=True))
        tl.store(out_ptr + offs * 4 + 2, c.to(tl.int32, bitcast=True))
        tl.store(out_ptr + offs * 4 + 3, d.to(tl.int32, bitcast=True))
        tl.store(u_ptr + offs, (a >> 8).to(tl.float32) * 5.9604644775390625e-08)
        r0, _, _, _ = tl.randint4x(seed, tl.load(pos_ptr + offs).to(tl.int32))
        tl.store(rint_ptr + offs, r0.to(tl.int32, bitcast=True))

    assert isinstance(_words_kernel, InterpretedFunction), type(_words_kernel)
    cases = json.loads(sys.argv[1])
    res = []
    for seed, purpose, index, positions in cases:
        pos = torch.tensor(positions, dtype=torch.int64)
        n = pos.numel()
        out = torch.empty(n * 4, dtype=torch.int32)
        u = torch.empty(n, dtype=torch.float32)
        rint = torch.empty(n, dtype=torch.int32)
        _words_kernel[(1,)](out, u, rint, pos, seed, purpose, index, N=n)
        res.append(dict(words=(out.long() & 0xFFFFFFFF).view(n, 4).tolist(),
                        u=u.tolist(), randint=(rint.long() & 0xFFFFFFFF).tolist()))
    print(json.dumps(res))
    """
)


@pytest.mark.slow
def test_matches_triton_philox_under_the_interpreter():
    positions = [0, 1, 2, 3, 1000, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 12345, 99]
    positions = positions + list(range(200, 204))  # 16 lanes (power of two for tl.arange)
    cases = [
        (0, int(Purpose.TARGET_SAMPLE), 0, positions),
        (12345, int(Purpose.ACCEPT), 0, positions),
        (2**32 + 7, int(Purpose.DRAFT_SAMPLE), 5, positions),
        (2**63 - 1, int(Purpose.ACCEPT), 2**31 + 3, positions),
        (0xDEADBEEFCAFEF00D, int(Purpose.TARGET_SAMPLE), 0, positions),
    ]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT, json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for (seed, purpose, index, pos), got in zip(cases, results, strict=True):
        pos_t = torch.tensor(pos, dtype=torch.int64)
        ours = torch.stack(random_words(seed, pos_t, Purpose(purpose), index), 1)  # [16, 4]
        assert ours.tolist() == got["words"], f"seed={seed} purpose={purpose} index={index}"
        u = uniforms(seed, pos_t, Purpose(purpose), index)
        assert torch.equal(u, torch.tensor(got["u"], dtype=torch.float32))
        # tl.randint4x(seed, offset) is counter (offset, 0, 0, 0): our TARGET_SAMPLE, index 0
        # for positions < 2^31 (a kernel's int32 offset).
        if purpose == Purpose.TARGET_SAMPLE and index == 0:
            small = [i for i, p in enumerate(pos) if p < 2**31]
            assert [got["randint"][i] for i in small] == ours[small, 0].tolist()
