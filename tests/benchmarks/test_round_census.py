"""benchmarks/round_census.py: the torch ops a round dispatches outside the op table — each a
kernel launch on a GPU — stay few. The round's bookkeeping moved into kernels/round_record.py
(362 such ops per round before, 44 after, at depth 5), its scalar arithmetic into
kernels/round_scalars.py (2 after: the target's embedding gather and depth 0's last-row
select); this holds that line and names the sites when glue comes back. Counts, not time:
nothing here is timed."""

from __future__ import annotations

import pytest
import torch

from benchmarks.round_census import GlueCounter, census

GLUE_PER_ROUND = 2  # measured at depth 5 on the small rank (twins and kernels alike)


@pytest.mark.slow
def test_the_round_dispatches_little_glue():
    counts, rounds = census("twins", depth=5, rounds=6)
    per_round = sum(counts.values()) / rounds
    sites = sorted(counts.items(), key=lambda kv: -kv[1])[:12]
    assert rounds >= 3
    assert per_round <= GLUE_PER_ROUND, f"{per_round:.1f} glue ops per round: {sites}"


def test_the_counter_counts_glue_and_skips_views(monkeypatch):
    """A planted glue op counts; views and allocations do not."""
    import benchmarks.round_census as rc

    monkeypatch.setattr(rc, "GLUE", (*rc.GLUE, "tests/benchmarks/test_round_census.py"))
    x = torch.arange(6)
    with GlueCounter() as c:
        y = x + 1  # one launch
        y.view(2, 3)  # a view: none
        torch.empty(3)  # an allocation: none
    assert sum(c.counts.values()) == 1
    ((name, site),) = c.counts
    assert name == "add" and "test_the_counter_counts_glue" in site


@pytest.mark.parametrize("argv", [["--rounds", "1"], ["--rounds", "0"], ["--depth", "-1"]])
def test_a_census_of_no_round_is_refused(argv, capsys):
    """A budget the prefill alone spends (or a negative depth) is an argument error, not a
    division by zero after the run."""
    from benchmarks.round_census import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "the request needs --rounds >= 2" in capsys.readouterr().err
