"""Device time of a piece of GPU work, measured as the engine runs it: captured once in a CUDA graph
and replayed between CUDA events (no launch overhead from Python in the figure)."""

from __future__ import annotations

from typing import Callable

import torch


def graph_replay_seconds(body: Callable[[], object], replays: int, warmup: int = 1,
                         after_capture: Callable[[], None] | None = None) -> float:
    """Capture ``body`` (already run once outside a graph: JIT, autotuning) in a CUDA graph; call
    ``after_capture`` (e.g. fill the static buffers the graph reads), replay ``warmup`` times, then
    ``replays`` times between events: seconds per replay."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    if after_capture is not None:
        after_capture()
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays
