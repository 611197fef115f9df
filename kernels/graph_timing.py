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


def cold_weight_seconds(call: Callable[[torch.Tensor], object], weight: torch.Tensor, repeats: int) -> float:
    """Seconds per ``call(w)`` in a graph of ``repeats`` calls that cycle through copies of ``weight``
    larger than the L2 cache together (as in a model, where each layer's weights come from HBM).
    ``call`` has run once outside (JIT, autotuning, cuBLAS's choice)."""
    l2_bytes = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 64 * 2**20)
    copies = max(1, -(-4 * l2_bytes // (weight.numel() * weight.element_size())))
    ws = [weight] + [weight.clone() for _ in range(copies - 1)]
    return graph_replay_seconds(lambda: [call(ws[i % copies]) for i in range(repeats)], replays=1) / repeats
