"""Flip rows of the tolerance table (the norms' bf16 outputs): legal rounding flips — rare per
row, clustered inside one on the elements of one mantissa — pass by max_rel, the count of rows
with a flip and the share of a row that differs, not by rms; more rows, a larger share, a large
error or NaN fail."""

import pytest
import torch

from qualification.tolerances import TABLE, grid_steps, measure, tolerance

ROW = ("kernels.residual_norm.attn_tail", "bf16")


def _up(x: torch.Tensor, steps: int = 1) -> torch.Tensor:  # positive bf16 values `steps` up
    return (x.view(torch.int16) + steps).view(torch.bfloat16)


@pytest.fixture
def twin():  # [8, 3072] positive bf16: one TP8 rank's hidden width, a width-8 call
    return (torch.rand(8, 3072, generator=torch.Generator().manual_seed(0)) + 0.5).bfloat16()


def test_the_norm_rows_are_flip_rows():
    rows = [t for t in TABLE.values() if t.flips]
    assert {(t.op, t.dtype) for t in rows} == {
        ROW, ("kernels.residual_norm.moe_tail", "bf16"), ("kernels.rows.norm", "bf16")}
    assert all("flip row" in t.source and "exp_norm_flips" in t.source for t in rows)


def test_the_h200s_cluster_passes_where_its_rms_would_not(twin):
    """27 elements of one row of a 4-row call, one mantissa at four exponents, one step off."""
    t = tolerance(*ROW)
    want = twin[:4].clone()
    cols = torch.arange(0, 27 * 100, 100)
    want[2, cols] = torch.tensor([1.90625, 0.953125, 0.4765625, 0.23828125]).repeat(7)[:27].to(
        torch.bfloat16)
    got = want.clone()
    got[2, cols] = _up(want[2, cols])
    m = measure(got, want, t)
    assert m.ok and (m.differ, m.rows_flipped, m.rows) == (27, 1, 4)
    assert m.rms_rel > t.rms_rel  # the rms criterion alone would fail it
    assert m.row_share == pytest.approx(27 / 3072)


def test_three_rows_or_a_large_share_of_a_row_fail(twin):
    t = tolerance(*ROW)
    three = twin.clone()
    three[[0, 3, 5], 7] = _up(three[[0, 3, 5], 7])
    m = measure(three, twin, t)
    assert m.rows_flipped == 3 > t.allowed_rows(8) and not m.ok
    wide = twin.clone()
    wide[4, : 3072 // 4] = _up(wide[4, : 3072 // 4])  # one row, a quarter of it
    m = measure(wide, twin, t)
    assert m.rows_flipped == 1 and m.row_share == 0.25 and not m.ok


def test_cancellation_may_take_many_grid_steps_within_max_rel(twin):
    want = twin.clone()
    want[1, 5] = 1e-3  # a small h where xn and an·scale nearly cancel
    got = want.clone()
    got[1, 5] = _up(want[1, 5], 40)
    m = measure(got, want, tolerance(*ROW))
    assert m.ok and m.steps == 40 and m.max_rel < tolerance(*ROW).max_rel


def test_a_large_error_or_nan_fails(twin):
    t = tolerance(*ROW)
    big = twin.clone()
    big[0, 9] = big[0, 9] * 1.05
    m = measure(big, twin, t)
    assert m.rows_flipped == 1 and m.max_rel > t.max_rel and not m.ok
    bad = twin.clone()
    bad[0, 0] = float("nan")
    assert not measure(bad, twin, t).ok


def test_a_moved_rounding_point_fails_many_times_over(twin):
    """Every element one step off its own rounding (the shape of 'f_in from FP32 h32')."""
    moved = (twin.float() * (1 + 2.0**-8)).bfloat16()
    m = measure(moved, twin, tolerance(*ROW))
    assert not m.ok and m.band_used > 3 and m.rows_flipped == 8


def test_grid_steps_count_across_zero_and_refuse_other_grids():
    z = torch.tensor([0.0, -0.0, 1e-40, -1e-40]).bfloat16()
    w = torch.tensor([-0.0, 0.0, -1e-40, 1e-40]).bfloat16()
    assert grid_steps(z, w, "bf16").tolist() == [0.0, 0.0, 2.0, 2.0]
    assert grid_steps(torch.tensor([1.0001]), torch.tensor([1.0]), "bf16").item() == float("inf")
    with pytest.raises(ValueError, match="no grid for dtype 'e5m2'"):
        grid_steps(z, w, "e5m2")
