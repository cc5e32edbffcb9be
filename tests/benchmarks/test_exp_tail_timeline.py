"""The tail timeline's milestone arithmetic on hand-made traces (the stamps themselves need a
GPU: tests/kernels/test_tails.py test_traced_launch_orders_its_stamps_gpu)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.exp_tail_timeline import main, milestones, summarize, table
from kernels.timeline import SLOTS, SM_SLOT


def launch(row_stamps, router_stamps, base: int) -> torch.Tensor:
    """[P, SLOTS] int64 of one launch: ns offsets per program (0 = never stamped), + base."""
    t = torch.zeros(len(row_stamps) + len(router_stamps), SLOTS, dtype=torch.int64)
    for i, st in enumerate(list(row_stamps) + list(router_stamps)):
        for k, v in enumerate(st):
            t[i, k] = base + v if v is not None else 0
        t[i, SM_SLOT] = i % 3  # an SM id, not a time
    return t


def test_milestones_measure_from_the_first_program_start():
    # 3 row programs (2 live, the third padding), 2 router programs; offsets in ns
    rows = [(1000, 3000, 4000, 5000), (1500, 3500, 4200, 6000), (1000, 9000, 9500, 9900)]
    router = [(2000, 7000, 7100, None, None, None, None, None, 6200),
              (1200, 8000, 8100, 11000, 8600, 9800, 10500, None, 6500)]
    tr = torch.stack([launch(rows, router, 10**12), launch(rows, router, 2 * 10**12)])
    ms = milestones(tr, live=2, rows=3)
    assert ms["rows summed"].tolist() == [2.5, 2.5]  # (3500 − 1000) ns, live rows only
    assert ms["rows stored"].tolist() == [3.2, 3.2]
    assert ms["rows end"].tolist() == [5.0, 5.0]
    assert ms["router start"].tolist() == [1.0, 1.0]
    assert ms["input first"].tolist() == [5.2, 5.2]  # slot 8
    assert ms["input last"].tolist() == [5.5, 5.5]
    assert ms["logits first"].tolist() == [6.0, 6.0]
    assert ms["logits last"].tolist() == [7.0, 7.0]
    assert ms["softmax"].tolist() == [7.6, 7.6]  # the routing program's slots 4–6
    assert ms["top-k"].tolist() == [8.8, 8.8]
    assert ms["published"].tolist() == [9.5, 9.5]
    assert ms["routed"].tolist() == [10.0, 10.0]
    assert ms["end"].tolist() == [10.0, 10.0]  # the SM ids in SM_SLOT are not times
    med, p10, p90 = summarize(ms)["routed"]
    assert med == p10 == p90 == 10.0


def test_milestones_without_router_programs():
    rows = [(0, 800, 900, 1000), (100, 700, 950, 1900)]
    ms = milestones(launch(rows, [], 5 * 10**11)[None], live=2, rows=2)
    assert set(ms) == {"rows summed", "rows stored", "rows end", "end"}
    assert ms["end"].item() == pytest.approx(1.9)


def test_table_leaves_missing_milestones_empty():
    res = [{"tail": "moe", "label": "pinned", "graph_us": 7.25,
            "milestones_us": {"rows end": (4.0, 3.5, 4.5), "end": (4.1, 3.6, 4.6)}}]
    md = table(res).splitlines()
    assert md[0].startswith("| tail | launch | graph µs | rows summed |")
    assert md[2].startswith("| moe | pinned | 7.25 |  | ")
    assert "4.00 (3.50–4.50)" in md[2]


def test_bad_variant_is_rejected_before_any_gpu_work():
    with pytest.raises(ValueError, match="tails.prefetch: unknown field"):
        main(["--variant", "prefetch=1"])
