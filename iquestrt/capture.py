"""Capturing a CUDA graph with Python's garbage collector paused.

A capture in PyTorch's default (global) mode is invalidated by any CUDA call the driver deems
unsafe meanwhile, and a collection inside the capture can run one: a garbage torch CUDAGraph
(an earlier engine's round graph held in a reference cycle) resets itself when collected, which
the driver refuses during a capture ("operation not permitted when stream is capturing (function
reset)"), and the capture then fails at its end with cudaErrorStreamCaptureInvalidated. Which
allocation triggers a collection depends on everything the process did before, so this showed
only in some test orders (pytest -n 4 on one H200). The cure is at the root: collect before the
capture (torch.cuda.graph does) and let no automatic collection run inside it; garbage made
during the capture waits for the next collection after it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic garbage collection inside the block (an explicit gc.collect() still runs);
    the collector's previous state is restored on exit."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, **kw) -> Iterator[None]:
    """torch.cuda.graph(graph, **kw) (pool=, stream=) with collection paused for its span."""
    with collection_paused(), torch.cuda.graph(graph, **kw):
        yield
