"""kernels.verify.verify_batch: B rounds in one launch, each exactly its twin
reference.twins.verify.verify_ref with the shared seed and its own first position, and exactly
the one-round `verify` (row kernels.verify)."""

from __future__ import annotations

import pytest
import torch

from kernels.verify import verify_batch
from qualification.tolerances import check
from reference.config import SamplingDefaults as SP
from reference.op_types import VerifyOut
from reference.twins.verify import verify_ref
from tests.kernels.test_verify import PARAMS, run, sampled_round

SEED = 2**63 + 12345


def pad(t: torch.Tensor, w: int, fill) -> torch.Tensor:
    return torch.cat([t, torch.full((*t.shape[:-1], w - t.shape[-1]), fill, dtype=t.dtype)], -1)


def batch(D: int, params: SP, B: int, V: int = 200):
    """B rounds (random rows and drafts), the shared SEED, first positions far apart."""
    rounds = [sampled_round(D, V, params, 300 + 7 * i + D, spread=0.5 + i % 3)._replace(
        seed=SEED, first=1000 + 97 * i) for i in range(B)]
    wp = max(r.p_ids.shape[1] for r in rounds)
    wq = max(r.q_ids.shape[1] for r in rounds)
    rounds = [r._replace(p_ids=pad(r.p_ids, wp, -1), p_probs=pad(r.p_probs, wp, 0.0),
                         q_ids=pad(r.q_ids, wq, -1), q_probs=pad(r.q_probs, wq, 0.0))
              for r in rounds]
    stacked = [torch.stack([r[k] for r in rounds]) for k in range(5)]
    return rounds, stacked, torch.tensor([r.first for r in rounds])


def outcomes(out, b: int) -> tuple[int, int, bool, list[int]]:
    a = int(out.n_accepted[b])
    em = out.emitted[b].tolist()
    assert all(v == -1 for v in em[a + 1 :]), f"round {b}: emitted tail {em}"
    return a, int(out.next_token[b]), bool(int(out.bonus[b])), em[: a + 1]


def as_tensor(o) -> torch.Tensor:
    return torch.tensor([o[0], o[1], int(o[2]), *o[3]])


@pytest.mark.parametrize("D", [1, 3, 7])
@pytest.mark.slow
def test_batch_equals_one_round_kernel_and_twin(D, device):
    seen = set()
    for params in PARAMS:
        rounds, stacked, first = batch(D, params, 12)
        out = verify_batch(*(t.to(device) for t in stacked), SEED, first.to(device))
        out = VerifyOut(*(t.cpu() for t in out))
        for b, r in enumerate(rounds):
            got = outcomes(out, b)
            check(as_tensor(got), as_tensor(verify_ref(*r)), "kernels.verify", "int64")
            check(as_tensor(got), as_tensor(run(r, device)), "kernels.verify", "int64")
            seen.add(got[0])
    assert len(seen) >= 2, "no case varied the accepted count"


def test_position_and_row_offsets_are_per_round(device):
    """The same rows at two first positions draw other uniforms: a kernel ignoring program b's
    position (or reading round 0's rows) would give every round round 0's outcome."""
    rounds, stacked, first = batch(5, SP(), 16)
    same = [t[:1].expand(16, *t.shape[1:]).contiguous() for t in stacked]
    out = verify_batch(*(t.to(device) for t in same), SEED, first.to(device))
    got = {tuple(out.emitted[b].tolist()) for b in range(16)}
    assert len(got) >= 3, f"16 positions gave {len(got)} distinct blocks"
    for b in range(16):
        want = verify_ref(*rounds[0]._replace(first=int(first[b])))
        check(as_tensor(outcomes(VerifyOut(*(t.cpu() for t in out)), b)), as_tensor(want),
              "kernels.verify", "int64")


def test_batch_errors(device):
    _, stacked, first = batch(2, SP(), 3)
    args = [t.to(device) for t in stacked]
    with pytest.raises(ValueError, match="first_positions must have shape"):
        verify_batch(*args, SEED, first[:2].to(device))
    with pytest.raises(ValueError, match="p_probs must be"):
        verify_batch(args[0], args[1].double(), *args[2:], SEED, first.to(device))
    with pytest.raises(ValueError, match="1..15 drafts"):
        verify_batch(*args[:4], args[4][:, :0], SEED, first.to(device))
    with pytest.raises(ValueError, match="contiguous"):
        verify_batch(args[0], args[1], args[2], args[3].transpose(1, 2).contiguous().transpose(
            1, 2), args[4], SEED, first.to(device))
