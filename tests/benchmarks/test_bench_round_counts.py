"""benchmarks.bench_round's accounting of the host loop: launched rounds, reads, and the split of
its extra time into over-run rounds and the gap per read (pure arithmetic, CPU)."""

from __future__ import annotations

from benchmarks.bench_round import CountingLauncher, host_gap


class Fake:
    def __init__(self, looping=None):
        self.calls = []
        if looping is not None:
            self.graph = type("G", (), {"looping": looping})()

    def launch(self, first, rounds):
        self.calls.append((first, rounds))


def test_counting_launcher_counts_reads_and_replays():
    inner = Fake()
    c = CountingLauncher(inner)
    c.launch(0, 8)
    c.launch(8, 8)
    assert (c.reads, c.launched, inner.calls) == (2, 16, [(0, 8), (8, 8)])
    looping = CountingLauncher(Fake(looping=True))
    looping.launch(0, 128)
    assert (looping.reads, looping.launched) == (1, None)


def test_host_gap_splits_extra_time():
    dev = dict(raw_s=[0.010, 0.010, 0.011], rounds=10)  # 1 ms per round
    host = dict(raw_s=[0.0135, 0.0136, 0.0135], rounds=10, launched_rounds=12, reads=2)
    line = host_gap(dev, host)
    # extra 3.5 ms = 2 over-run rounds (2 ms) + 1.5 ms over 2 reads
    assert "2 over-run rounds ≈ 2000 us" in line and "750.0 us per read" in line
