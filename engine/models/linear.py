"""``Linear``: ``nn.Linear`` whose one-row calls (batch-1 decode) may go to a GEMV kernel, chosen
per weight shape by timing it against cuBLAS on the device (``choose_gemv``)."""

from __future__ import annotations

import logging
from typing import Callable, Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

Gemv = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# (weight, bias) -> (use the GEMV kernel, its µs, cuBLAS µs)
GemvTimer = Callable[[torch.Tensor, "torch.Tensor | None"], tuple[bool, float, float]]


# (x, weight, bias, residual, norm weight, eps, counter) -> (normalised, new residual), as
# kernels.triton.gemv.gemv_add_rms_norm
GemvAddNorm = Callable[..., tuple[torch.Tensor, torch.Tensor]]
AddNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


class Linear(nn.Linear):
    gemv: Gemv | None = None  # set on an instance when the timer chose the kernel for its shape
    # set on an instance for inputs of 1 to small_gemm_rows rows the GEMV does not take (use_small_gemm)
    small_gemm: Gemv | None = None
    small_gemm_rows: int = 0
    gemv_add_norm: GemvAddNorm | None = None  # set with ``gemv`` where the kernel has the add+norm epilogue
    _counter: torch.Tensor | None = None  # the epilogue's counter (one per layer: kernels of a step may overlap),
    # allocated with ``gemv_add_norm`` by ``choose_gemv``, outside any graph capture
    # tensor parallelism: the ranks' outputs made one (summed for a row-parallel layer, concatenated for
    # the vocab-parallel head)
    combine: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.dim() == 2 and x.shape[0] == 1:
            out = self.gemv(x, self.weight, self.bias)
        elif self.small_gemm is not None and x.dim() == 2 and x.shape[0] <= self.small_gemm_rows:
            out = self.small_gemm(x, self.weight, self.bias)
        else:
            out = super().forward(x)
        return out if self.combine is None else self.combine(out)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         add_rms_norm: AddNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm(self(x), residual, norm_weight, eps)``: (normalised, new residual); a one-row x
        through the GEMV kernel adds and normalises in the kernel's last program (no separate launch), but
        for a row-parallel layer, whose output is summed over the ranks first."""
        if (self.gemv_add_norm is not None and self.combine is None and x.dim() == 2 and x.shape[0] == 1
                and residual.is_contiguous()):
            return self.gemv_add_norm(x, self.weight, self.bias, residual, norm_weight, eps, self._counter)
        return add_rms_norm(self(x), residual, norm_weight, eps)


WeightKey = tuple[tuple[int, ...], bool, torch.dtype]  # (weight shape, has a bias, dtype): what a kernel is chosen by


def _linear_layers(model: nn.Module) -> Iterator[tuple[Linear, WeightKey]]:
    for module in model.modules():
        if isinstance(module, Linear):
            yield module, (tuple(module.weight.shape), module.bias is not None, module.weight.dtype)


def choose_gemv(model: nn.Module, gemv: Gemv, timer: GemvTimer,
                gemv_add_norm: GemvAddNorm | None = None) -> dict[str, dict[str, float | bool]]:
    """Time each distinct (weight shape, bias, dtype) of the model's ``Linear`` layers once and give
    the layers whose shape the timer chose ``gemv`` for that kernel (and ``gemv_add_norm``, its variant
    with the add+norm epilogue); returns the timings by shape."""
    timed: dict[WeightKey, tuple[bool, float, float]] = {}
    for module, key in _linear_layers(model):
        if key not in timed:
            timed[key] = timer(module.weight, module.bias)
        module.gemv = gemv if timed[key][0] else None
        module.gemv_add_norm = gemv_add_norm if timed[key][0] else None
        if module.gemv_add_norm is not None:
            module._counter = torch.zeros(1, dtype=torch.int32, device=module.weight.device)
    report = {f"{shape[0]}x{shape[1]}" + ("+bias" if bias else ""): {"gemv": use, "gemv_us": round(g, 2),
                                                                     "cublas_us": round(c, 2)}
              for (shape, bias, _), (use, g, c) in timed.items()}
    logger.info("one-row linear layers: %s", report)
    return report


def use_small_gemm(model: nn.Module, small_gemm: Gemv, max_rows: int,
                   prepare: Callable[[torch.Tensor, "torch.Tensor | None", int], None]) -> None:
    """Give every ``Linear`` of the model ``small_gemm`` for inputs of up to ``max_rows`` rows, after
    ``prepare`` (weight, bias, max_rows) has run it once per distinct weight shape (its tuning, outside
    any graph capture)."""
    prepared: set[WeightKey] = set()
    for module, key in _linear_layers(model):
        if key not in prepared:
            prepare(module.weight, module.bias, max_rows)
            prepared.add(key)
        module.small_gemm, module.small_gemm_rows = small_gemm, max_rows
