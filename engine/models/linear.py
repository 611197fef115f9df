"""``Linear``: ``nn.Linear`` whose one-row calls (batch-1 decode) may go to a GEMV kernel, chosen
per weight shape by timing it against cuBLAS on the device (``choose_gemv``)."""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

Gemv = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# (weight, bias) -> (use the GEMV kernel, its µs, cuBLAS µs)
GemvTimer = Callable[[torch.Tensor, "torch.Tensor | None"], tuple[bool, float, float]]


class Linear(nn.Linear):
    gemv: Gemv | None = None  # set on an instance when the kernel measured faster for its shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.dim() == 2 and x.shape[0] == 1:
            return self.gemv(x, self.weight, self.bias)
        return super().forward(x)


def choose_gemv(model: nn.Module, gemv: Gemv, timer: GemvTimer) -> dict[str, dict[str, float | bool]]:
    """Time each distinct (weight shape, bias, dtype) of the model's ``Linear`` layers once and give
    the layers whose shape was faster with ``gemv`` that kernel; returns the timings by shape."""
    timed: dict[tuple[tuple[int, ...], bool, torch.dtype], tuple[bool, float, float]] = {}
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        key = (tuple(module.weight.shape), module.bias is not None, module.weight.dtype)
        if key not in timed:
            timed[key] = timer(module.weight, module.bias)
        module.gemv = gemv if timed[key][0] else None
    report = {f"{shape[0]}x{shape[1]}" + ("+bias" if bias else ""): {"gemv": use, "gemv_us": round(g, 2),
                                                                     "cublas_us": round(c, 2)}
              for (shape, bias, _), (use, g, c) in timed.items()}
    logger.info("one-row linear layers: %s", report)
    return report
