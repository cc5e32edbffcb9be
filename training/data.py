"""Token shards and a deterministic, resumable batch order.

A shard is a flat file of uint16 token ids (`train.bin`, `heldout.bin`; `<|endoftext|>`
separates documents and attention runs across it, as in GPT-2-style training). It is cut into
chunks of seq_len + 1 tokens that overlap by one token (chunk c = tokens[c·T : c·T + T + 1]:
inputs are the first T, labels the last T). Each epoch visits every chunk once in the order of a
permutation drawn from numpy's PCG64 seeded with (seed, epoch); the cursor (epoch, offset) is the
whole state, so a resumed run continues with exactly the batches it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class DataError(ValueError):
    """A shard is missing, malformed or incompatible with the model; the message names it."""


def load_shard(path: Path, vocab_size: int, min_tokens: int) -> np.ndarray:
    """Memory-mapped uint16 tokens [N], checked: readable, N ≥ min_tokens, ids < vocab_size."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: token shard missing")
    size = path.stat().st_size
    if size % 2:
        raise DataError(f"{path}: {size} bytes is not a whole number of uint16 tokens")
    if size // 2 < min_tokens:
        raise DataError(f"{path}: {size // 2} tokens, need at least {min_tokens} (seq_len + 1)")
    tokens = np.memmap(path, dtype="<u2", mode="r")  # little-endian uint16
    top = int(tokens.max())
    if top >= vocab_size:
        first = int(np.argmax(tokens >= vocab_size))
        raise DataError(
            f"{path}: token id {top} (first bad one at index {first}) outside the model's "
            f"vocabulary [0, {vocab_size})"
        )
    return tokens


def chunk(tokens: np.ndarray, index: int, seq_len: int) -> np.ndarray:
    return np.asarray(tokens[index * seq_len : index * seq_len + seq_len + 1], dtype=np.int64)


@dataclass(frozen=True)
class Cursor:
    epoch: int = 0
    offset: int = 0  # chunks of this epoch's permutation already served


class BatchOrder:
    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.n_chunks = (len(tokens) - 1) // seq_len
        if self.n_chunks < batch_size:
            raise DataError(
                f"training shard: {self.n_chunks} chunks of {seq_len + 1} tokens, fewer than "
                f"batch_size={batch_size}"
            )
        self.cursor = Cursor()
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm, self._perm_epoch = rng.permutation(self.n_chunks), epoch
        return self._perm

    def next_batch(self) -> torch.Tensor:
        """[batch_size, seq_len + 1] int64; a batch never straddles two epochs (the tail of an
        epoch's permutation that cannot fill a batch is skipped)."""
        c = self.cursor
        if c.offset + self.batch_size > self.n_chunks:
            c = Cursor(c.epoch + 1, 0)
        ids = self._permutation(c.epoch)[c.offset : c.offset + self.batch_size]
        self.cursor = Cursor(c.epoch, c.offset + self.batch_size)
        return torch.from_numpy(np.stack([chunk(self.tokens, int(i), self.seq_len) for i in ids]))

    @property
    def epochs_done(self) -> float:
        return self.cursor.epoch + self.cursor.offset / self.n_chunks

    @property
    def steps_per_epoch(self) -> int:
        return self.n_chunks // self.batch_size


def heldout_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_tokens: int):
    """Consecutive chunks from the start of the held-out shard, at most max_tokens inputs."""
    n = min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len))
    for start in range(0, n, batch_size):
        ids = range(start, min(n, start + batch_size))
        yield torch.from_numpy(np.stack([chunk(tokens, i, seq_len) for i in ids]))
