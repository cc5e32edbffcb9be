"""iquestrt/capture.py: no automatic garbage collection inside a CUDA graph capture.

On the CPU: the collector's state around the block, and a cycle with a finalizer that stays
uncollected inside the block however many containers are allocated. On a GPU: the hazard itself —
a garbage CUDAGraph collected inside a capture invalidates it (plain torch.cuda.graph), while
graph_capture captures and replays (each in a fresh process: a failed capture is not left in the
test process)."""

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from iquestrt.capture import collection_paused

ROOT = Path(__file__).resolve().parents[2]


class _Finalized:
    def __init__(self, log: list):
        self.log, self.me = log, self  # a reference cycle: only the collector frees it

    def __del__(self):
        self.log.append("collected")


def test_collection_paused_restores_the_collectors_state():
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
    with pytest.raises(KeyError), collection_paused():
        raise KeyError("inside")
    assert gc.isenabled()


def test_no_collection_runs_inside_the_block():
    log: list = []
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # a collection at nearly every container allocation
    try:
        with collection_paused():
            _Finalized(log)
            junk = [[i] for i in range(10_000)]
            assert log == [], "a collection ran inside the block"
        del junk
        _Finalized(log)  # the collector is back: some allocation now collects both cycles
        junk = [[i] for i in range(10_000)]
        assert log, "no collection after the block: the check above proves nothing"
        del junk
    finally:
        gc.set_threshold(*threshold)
        gc.collect()


# A captured graph kept only by a reference cycle becomes garbage inside the next capture; then
# many container allocations under threshold 1 make the collector run there (unless paused).
CAPTURE = """
import gc, torch
from iquestrt.capture import graph_capture
x = torch.ones(4, device="cuda")
old = torch.cuda.CUDAGraph()
with torch.cuda.graph(old):
    x.add_(1)
holder = {"graph": old}
holder["self"] = holder
del old
gc.set_threshold(1, 1, 1)
g = torch.cuda.CUDAGraph()
with CTX(g):
    del holder
    junk = [[i] for i in range(20000)]
    x.mul_(2)
g.replay()
torch.cuda.synchronize()
print("replayed", float(x[0]))
"""


def _capture_in_a_fresh_process(ctx: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CAPTURE.replace("CTX", ctx)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.gpu
def test_a_collection_inside_a_capture_breaks_it_and_graph_capture_prevents_it():
    plain = _capture_in_a_fresh_process("torch.cuda.graph")
    assert plain.returncode != 0 and "captur" in plain.stderr, plain.stdout + plain.stderr[-2000:]
    paused = _capture_in_a_fresh_process("graph_capture")
    assert paused.returncode == 0, paused.stderr[-2000:]
    assert paused.stdout.split()[-1] == "2.0"  # captures do not run: 1, doubled by one replay
