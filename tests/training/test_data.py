"""training/data.py: shard checks name the file and the problem; the batch order is a function
of (seed, cursor) only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.data import BatchOrder, Cursor, DataError, heldout_batches, load_shard


def _shard(path, values):
    np.asarray(values, dtype=np.uint16).tofile(path)
    return path


def test_shard_errors_name_file_and_problem(tmp_path):
    with pytest.raises(DataError, match=r"missing\.bin: token shard missing"):
        load_shard(tmp_path / "missing.bin", 16, 4)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"odd\.bin: 3 bytes is not a whole number"):
        load_shard(odd, 16, 1)
    with pytest.raises(DataError, match=r"short\.bin: 3 tokens, need at least 4"):
        load_shard(_shard(tmp_path / "short.bin", [1, 2, 3]), 16, 4)
    bad = _shard(tmp_path / "bad.bin", [1, 2, 16, 3, 40])
    with pytest.raises(DataError, match=r"bad\.bin: token id 40 \(first bad one at index 2\)"):
        load_shard(bad, 16, 4)


def test_batches_cover_each_epoch_once_and_resume_from_the_cursor(tmp_path):
    seq, batch = 4, 3
    tokens = load_shard(_shard(tmp_path / "t.bin", np.arange(41)), 64, seq + 1)
    order = BatchOrder(tokens, seq, batch, seed=5)
    assert order.n_chunks == 10 and order.steps_per_epoch == 3
    served = [order.next_batch() for _ in range(7)]  # 3 batches per epoch, 1 chunk skipped
    for b in served:  # each row is a chunk: 5 consecutive stream tokens
        assert b.shape == (batch, seq + 1)
        assert torch.equal(b[:, 1:], b[:, :-1] + 1) and (b[:, 0] % seq == 0).all()
    firsts = [int(b[r, 0]) // seq for b in served[:3] for r in range(batch)]
    assert len(set(firsts)) == 9  # epoch 0: nine distinct chunks of ten
    assert order.cursor == Cursor(2, 3)

    again = BatchOrder(tokens, seq, batch, seed=5)
    again.cursor = Cursor(1, 3)  # resume in the middle of epoch 1
    assert all(torch.equal(again.next_batch(), served[i]) for i in (4, 5, 6))
    other = BatchOrder(tokens, seq, batch, seed=6)
    assert any(not torch.equal(other.next_batch(), served[i]) for i in range(3))


def test_heldout_batches_are_the_leading_chunks(tmp_path):
    tokens = load_shard(_shard(tmp_path / "h.bin", np.arange(30)), 64, 5)
    got = torch.cat(list(heldout_batches(tokens, 4, 2, max_tokens=12)))
    assert torch.equal(got, torch.stack([torch.arange(4 * i, 4 * i + 5) for i in range(3)]))
