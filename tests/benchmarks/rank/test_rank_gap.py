"""The gap analysis of a rank record (benchmarks/rank/gap.py): per-family lower bounds from the
per-launch cost and the floor bytes, the launch budget of the 1.5 × target, clear refusals."""

import json

import pytest

from benchmarks.rank.gap import gap_of, main, markdown


def _record(**over) -> dict:
    bd = {"launches": 300, "kernel_s": 900e-6,
          "by_family": {"moe": [100, 600e-6], "tails": [200, 300e-6]},
          "top_kernels": {"_moe_gate_up_kernel": [100, 600e-6], "_moe_tail_kernel": [200, 300e-6],
                          "tiny": [10, 10e-6]}}
    row = {"context_name": "1K", "policy": "W6", "round_s": 1200e-6, "floor_s": 100e-6,
           "breakdown": bd, "floor_terms": {"experts": 2e8, "routers": 1e6}}
    row.update(over)
    return {"spec": {"headline_width": 6}, "bandwidth": 1e12, "configs": [row]}


def test_bounds_and_launch_budget():
    g = gap_of(_record())
    assert g.shortest_s == pytest.approx(1e-6) and g.gap_s == pytest.approx(1e-6)
    moe, tails = g.families
    assert (moe.family, moe.bytes_s, moe.bound_s) == ("moe", pytest.approx(200e-6),
                                                      pytest.approx(200e-6))  # bytes-bound
    assert tails.bound_s == pytest.approx(400e-6)  # 200 launches × 2 µs > 1 µs of bytes
    assert g.bound_s == pytest.approx(600e-6)
    # target 150 µs, minus moe's 200 µs of bytes: no launches fit
    assert g.launches_allowed() == 0
    roomy = gap_of(_record(floor_s=300e-6))  # target 450 µs: (450 − 200) / 2 = 125 launches
    assert roomy.launches_allowed() == 125
    text = markdown(roomy)
    assert "| tails | 200 | 300 |" in text and "about **125 launches**" in text


def test_refusals(tmp_path, capsys):
    with pytest.raises(ValueError, match="no 4K W6 configuration with a per-kernel breakdown"):
        gap_of(_record(), "4K")
    with pytest.raises(ValueError, match="floor term 'mystery' has no family"):
        gap_of(_record(floor_terms={"mystery": 1.0}))
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_record(floor_terms={"mystery": 1.0})))
    assert main([str(path)]) == 2
    assert "has no family" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json")]) == 2
