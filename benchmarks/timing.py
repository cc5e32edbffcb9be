"""CUDA-graph timing shared by the benchmarks: capture a graph of `reps` calls cycling through
`calls` (each warmed up eagerly first, so compilation stays outside the capture), replay it,
and report the median µs per call from CUDA events. Calls are expected to rotate buffers or
weights so that the working set exceeds the L2 (each benchmark documents how)."""

from __future__ import annotations

import statistics

import torch

from iquestrt.capture import graph_capture


def capture_graph(calls, reps: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        for j in range(reps):
            calls[j % len(calls)]()
    return graph


def time_graph(calls, reps: int, trials: int, warmup: int) -> float:
    """Median µs per call over `trials` replays of a graph of `reps` calls."""
    graph = capture_graph(calls, reps)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(times)
