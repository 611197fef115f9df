"""Each distinct linear layer of a model timed alone at the decode batch size, against its own
roofline: the weight bytes at the measured copy bandwidth or the FLOPs at the measured matmul rate,
whichever is longer. Near the ridge point (an 8B model at batch 256 on an H200) a GEMM's output
tiles may not fill the device; this shows per weight shape how far cuBLAS is from the bound, in the
same run as ``bench latency``'s step time (batch 1 has its own report: GEMV against cuBLAS)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modeserve.kernels.graph_timing import graph_replay_seconds
from modeserve.service.bench_limits import ratio


def linear_report(model: nn.Module, rows: int, bandwidth: float, flops: float, repeats: int = 20) -> dict[str, Any]:
    """Per weight shape ``"NxK"`` (CUDA): µs per ``linear`` call at ``rows`` rows, its bound in µs, their
    ratio, and the calls per step. Each call reads another copy of the weight (together more than
    L2 holds), as consecutive layers do."""
    shapes: dict[tuple[int, int], tuple[nn.Linear, int]] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            key = (module.weight.shape[0], module.weight.shape[1])
            first, count = shapes.get(key, (module, 0))
            shapes[key] = (first, count + 1)
    report: dict[str, Any] = {}
    for (n, k), (layer, count) in shapes.items():
        w, b = layer.weight, layer.bias
        l2_bytes = getattr(torch.cuda.get_device_properties(w.device), "L2_cache_size", 64 * 2**20)
        copies = max(2, -(-4 * l2_bytes // (w.numel() * w.element_size())))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        x = torch.randn(rows, k, dtype=w.dtype, device=w.device)
        torch.nn.functional.linear(x, w, b)  # cuBLAS picks its kernel outside the graph
        calls = lambda: [torch.nn.functional.linear(x, ws[i % copies], b) for i in range(repeats)]  # noqa: E731
        seconds = graph_replay_seconds(calls, replays=1) / repeats
        bound = max(n * k * w.element_size() / bandwidth, 2 * rows * n * k / flops)
        report[f"{n}x{k}"] = {"us": round(seconds * 1e6, 2), "bound_us": round(bound * 1e6, 2),
                              "ratio": ratio(bound / seconds), "calls_per_step": count}
        del ws
    return report
