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


def time_graphs_alternating(variants: dict[str, list], reps: int, trials: int,
                            warmup: int) -> dict[str, float]:
    """Median µs per call of each variant's graph (`reps` calls cycling through its calls), the
    variants' replays alternating trial by trial (A B A′ B′ …), so drift in clocks or
    temperature lands on all of them alike."""
    graphs = {name: capture_graph(calls, reps) for name, calls in variants.items()}
    for g in graphs.values():
        for _ in range(warmup):
            g.replay()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for t in range(trials):
        names = list(graphs) if t % 2 == 0 else list(reversed(graphs))
        for name in names:
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / reps)
    del graphs
    return {name: statistics.median(v) for name, v in times.items()}
