"""Flip rows of the tolerance table (the norms' bf16 outputs): legal rounding flips pass by grid
steps and count, not by rms; more steps, more flips, NaN or off-grid values fail."""

import pytest
import torch

from qualification.tolerances import TABLE, grid_steps, measure, tolerance

ROW = ("kernels.residual_norm.attn_tail", "bf16")


def _up(x: torch.Tensor, steps: int) -> torch.Tensor:  # a positive bf16 value `steps` grid up
    return (x.view(torch.int16) + steps).view(torch.bfloat16)


@pytest.fixture
def twin():  # [3, 3072] positive bf16: one TP8 rank's hidden width, 3 rows
    return (torch.rand(3, 3072, generator=torch.Generator().manual_seed(0)) + 0.5).bfloat16()


def test_the_norm_rows_are_flip_rows():
    rows = [t for t in TABLE.values() if t.flips]
    assert {(t.op, t.dtype) for t in rows} == {
        ROW, ("kernels.residual_norm.moe_tail", "bf16"), ("kernels.rows.norm", "bf16")}
    assert all("flip row" in t.source for t in rows)


def test_a_few_flips_of_large_elements_pass_where_their_rms_would_not(twin):
    got = twin.clone()
    big = twin.view(-1).float().topk(6).indices
    for i in big[:4]:
        got.view(-1)[i] = _up(got.view(-1)[i], 2)
    m = measure(got, twin, tolerance(*ROW))
    assert m.ok and (m.differ, m.n, m.ulps) == (4, 3 * 3072, 2.0)
    assert m.rms_rel > tolerance(*ROW).rms_rel  # the old rms criterion would have failed it
    assert m.band_used == pytest.approx(1.0)


def test_three_steps_or_too_many_flips_fail(twin):
    t = tolerance(*ROW)
    three = twin.clone()
    three[1, 7] = _up(three[1, 7], 3)
    m = measure(three, twin, t)
    assert not m.ok and m.ulps == 3 and m.worst_index == (1, 7)
    many = twin.clone()
    n = int(t.allowed_flips(twin.numel())) + 1
    many.view(-1)[:n] = _up(many.view(-1)[:n], 1)
    m = measure(many, twin, t)
    assert not m.ok and m.differ == n and m.ulps == 1


def test_a_moved_rounding_point_fails_by_count(twin):
    """Every element one step off its own rounding (the shape of 'f_in from FP32 h32')."""
    moved = (twin.float() * (1 + 2.0**-8)).bfloat16()
    m = measure(moved, twin, tolerance(*ROW))
    assert not m.ok and m.differ > 0.3 * twin.numel()


def test_nan_and_off_grid_values_fail(twin):
    t = tolerance(*ROW)
    bad = twin.clone()
    bad[0, 0] = float("nan")
    assert not measure(bad, twin, t).ok
    off = twin.float()
    off[2, 5] += 1e-4  # not a bf16 value
    m = measure(off, twin.float(), t)
    assert not m.ok and m.ulps == float("inf")


def test_grid_steps_count_across_zero():
    z = torch.tensor([0.0, -0.0, 1e-40, -1e-40]).bfloat16()
    w = torch.tensor([-0.0, 0.0, -1e-40, 1e-40]).bfloat16()
    assert grid_steps(z, w, "bf16").tolist() == [0.0, 0.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="no grid for dtype 'e5m2'"):
        grid_steps(z, w, "e5m2")
