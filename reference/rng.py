"""Counter-based random numbers: Philox4x32-10 in torch int64 arithmetic.

Every random number a sampling step consumes is a pure function of
(request seed, token position, purpose, index), so a Triton kernel, another tensor-parallel
rank or a replayed CUDA graph reproduces it bit for bit without any generator state.

Mapping onto Triton (3.6): `tl.philox(seed, c0, c1, c2, c3)` with a uint64 `seed` and uint32
counter words uses key (k0, k1) = (seed & 0xffffffff, seed >> 32) — exactly our key — so

    x, _, _, _ = tl.philox(seed, position.to(tl.uint32), purpose, index, 0)
    u = (x >> 8).to(tl.float32) * 5.9604644775390625e-08        # 2**-24

reproduces `uniforms(seed, positions, purpose, index)`. (`tl.randint4x(seed, offset)` is the
special case counter = (offset_lo, offset_hi, 0, 0); it cannot carry our purpose/index words.)
The round function is the Random123 one (its `kat_vectors` pass, see tests/reference/test_rng.py).

u = (x >> 8) · 2⁻²⁴ takes the top 24 bits of the first output word: every value k·2⁻²⁴,
k ∈ [0, 2²⁴), is exactly representable in fp32, so u ∈ [0, 1) with no rounding anywhere.

Reuse of a counter: a draft uniform (DRAFT_SAMPLE, position t) can be consumed again when a
later round re-drafts position t, but only if the earlier draft at t was never judged (a
rejection happened before t), so it is independent of everything committed. ACCEPT and
TARGET_SAMPLE at position t are consumed once: after that the token at t is committed.
"""

from __future__ import annotations

from enum import IntEnum

import torch

M0 = 0xD2511F53  # round multiplier applied to counter word 0
M1 = 0xCD9E8D57  # round multiplier applied to counter word 2
W0 = 0x9E3779B9  # key schedule increment, key word 0
W1 = 0xBB67AE85  # key schedule increment, key word 1
ROUNDS = 10
MASK32 = 0xFFFFFFFF
U24_SCALE = 2.0**-24


class Purpose(IntEnum):
    """Counter word 1: keeps the streams of different uses of one position apart."""

    TARGET_SAMPLE = 0  # plain target sampling, the rejection replacement, the bonus token
    ACCEPT = 1  # the acceptance uniform of a draft token
    DRAFT_SAMPLE = 2  # the draft's own sample


class RngError(ValueError):
    """A seed, position, purpose or index is out of range; the message names it."""


def _mulhilo(m: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # m·c < 2⁶⁴ overflows int64, so multiply by 16-bit halves of c: every partial < 2⁴⁹.
    a = m * (c & 0xFFFF)  # [2, N] < 2^48
    b = m * (c >> 16)  # [2, N] < 2^48
    t = a + ((b & 0xFFFF) << 16)  # [2, N] < 2^49
    return (b >> 16) + (t >> 32), t & MASK32


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[int, int],
    rounds: int = ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 on int64 tensors holding uint32 words (broadcast to one shape [N])."""
    c0, c1, c2, c3 = torch.broadcast_tensors(*(w.to(torch.int64) for w in counter))
    for i, w in enumerate((c0, c1, c2, c3)):
        if w.numel() and (int(w.min()) < 0 or int(w.max()) > MASK32):
            raise RngError(f"philox4x32: counter word {i} must hold values in [0, 2^32)")
    k0, k1 = key
    if not (0 <= k0 <= MASK32 and 0 <= k1 <= MASK32):
        raise RngError(f"philox4x32: key words must be in [0, 2^32), got ({k0}, {k1})")
    m = torch.tensor([[M0], [M1]], dtype=torch.int64, device=c0.device)  # [2, 1]
    for _ in range(rounds):
        hi, lo = _mulhilo(m, torch.stack((c0, c2)))  # [2, N]: M0·c0 and M1·c2
        c0, c1, c2, c3 = hi[1] ^ c1 ^ k0, lo[1], hi[0] ^ c3 ^ k1, lo[0]
        k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
    return c0, c1, c2, c3


def split_seed(seed: int) -> tuple[int, int]:
    """The 64-bit request seed as Philox key words (lo, hi)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise RngError(f"seed must be an integer in [0, 2^64), got {seed!r}")
    return seed & MASK32, seed >> 32


def random_words(
    seed: int, positions: torch.Tensor, purpose: Purpose, index: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four raw uint32 words (as int64 [R]) for counter (position, purpose, index, 0)."""
    key = split_seed(seed)
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64:
        raise RngError("positions must be an int64 tensor")
    if positions.dim() != 1:
        raise RngError(f"positions must be 1-D [R], got shape {tuple(positions.shape)}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) > MASK32):
        raise RngError(
            f"positions must be in [0, 2^32), got range "
            f"[{int(positions.min())}, {int(positions.max())}]"
        )
    try:
        purpose = Purpose(purpose)
    except ValueError:
        raise RngError(f"purpose must be one of {list(Purpose)}, got {purpose!r}") from None
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MASK32:
        raise RngError(f"index must be an integer in [0, 2^32), got {index!r}")
    pos = positions.cpu()  # [R]
    words = (pos, torch.full_like(pos, int(purpose)), torch.full_like(pos, index), pos * 0)
    return philox4x32(words, key)


def uniforms(seed: int, positions: torch.Tensor, purpose: Purpose, index: int = 0) -> torch.Tensor:
    """u [R] fp32 in [0, 1): the top 24 bits of Philox word 0, times 2⁻²⁴ (exact)."""
    x = random_words(seed, positions, purpose, index)[0]  # [R] uint32 values in int64
    return ((x >> 8).to(torch.float32) * U24_SCALE).to(positions.device)
