"""Each distinct linear layer of a model timed alone at the decode batch size, against its own
roofline: the weight bytes at the measured copy bandwidth or the FLOPs at the measured matmul rate,
whichever is longer. Near the ridge point (an 8B model at batch 256 on an H200) a GEMM's output
tiles may not fill the device; this shows per weight shape how far cuBLAS is from the bound, in the
same run as ``bench latency``'s step time (batch 1 has its own report: GEMV against cuBLAS). Beside
each, split-K by hand: the K dimension cut in 2 or 4 and run as one batched cuBLAS GEMM (as many
output tiles times the splits, for shapes whose tiles would leave SMs idle), then summed in fp32 —
the data for choosing it; the engine does not use it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...kernels.graph_timing import cold_weight_seconds
from .limits import ratio


def linear_report(model: nn.Module, rows: int, bandwidth: float, flops: float, repeats: int = 20) -> dict[str, Any]:
    """Per weight shape ``"NxK"`` (CUDA): µs per ``linear`` call at ``rows`` rows, its bound in µs, their
    ratio, and the calls per step. The calls cycle through copies of the weight past L2, as
    consecutive layers read theirs (``cold_weight_seconds``)."""
    shapes: dict[tuple[int, int], tuple[nn.Linear, int]] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            key = (module.weight.shape[0], module.weight.shape[1])
            first, count = shapes.get(key, (module, 0))
            shapes[key] = (first, count + 1)
    report: dict[str, Any] = {}
    for (n, k), (layer, count) in shapes.items():
        w, b = layer.weight, layer.bias
        x = torch.randn(rows, k, dtype=w.dtype, device=w.device)
        call = lambda w, x=x, b=b: torch.nn.functional.linear(x, w, b)  # noqa: E731
        call(w)  # cuBLAS picks its kernel outside the graph
        seconds = cold_weight_seconds(call, w, repeats)
        bound = max(n * k * w.element_size() / bandwidth, 2 * rows * n * k / flops)
        split_us = {}
        for splits in (2, 4):
            if k % splits == 0:
                call_split = lambda w, x=x, s=splits: split_k_linear(x, w, s)  # noqa: E731
                call_split(w)
                split_us[str(splits)] = round(cold_weight_seconds(call_split, w, repeats) * 1e6, 2)
        report[f"{n}x{k}"] = {"us": round(seconds * 1e6, 2), "bound_us": round(bound * 1e6, 2),
                              "ratio": ratio(bound / seconds), "calls_per_step": count, "split_k_us": split_us}
    return report


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """``x @ weight.T`` (x [M, K], weight [N, K], K a multiple of ``splits``) as one batched GEMM over
    ``splits`` slices of K, the partial products summed in fp32 and rounded to x's dtype once more."""
    m, k = x.shape
    n = weight.shape[0]
    if k % splits or weight.shape[1] != k:
        raise ValueError(f"split_k_linear needs K ({k}) a multiple of splits ({splits}) and weight [N, {k}]")
    xs = x.view(m, splits, k // splits).transpose(0, 1)  # [S, M, K/S]
    ws = weight.view(n, splits, k // splits).permute(1, 2, 0)  # [S, K/S, N]
    return torch.bmm(xs, ws).sum(0, dtype=torch.float32).to(x.dtype)
