"""The few-row GEMM kernel equals ``torch.nn.functional.linear`` at every row count up to its limit and
at edges of its tiles; ``use_small_gemm`` gives it to every ``Linear`` for those row counts only. Without
a GPU the kernel runs in Triton's CPU interpreter with a fixed tile."""

from __future__ import annotations

import pytest
import torch
from modeserve.engine.models.linear import Linear, use_small_gemm
from modeserve.kernels.op_set import SMALL_GEMM_MAX_ROWS
from modeserve.kernels.triton.small_gemm import block_rows, small_gemm
from torch import nn


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,config", [(1, 40, 96, (16, 32)), (2, 33, 100, (16, 64)), (17, 64, 64, (32, 16)),
                                          (32, 48, 80, (16, 32)), (SMALL_GEMM_MAX_ROWS, 24, 48, (16, 16))])
def test_small_gemm_equals_linear(m: int, n: int, k: int, config: tuple[int, int], bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 7 + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = small_gemm(x, w, b, config=config)
    assert y.shape == (m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_small_gemm_reads_a_strided_input() -> None:
    """A view of every other row (the layer's input may be a slice of a larger buffer)."""
    w, x = torch.randn(32, 64), torch.randn(8, 64)
    torch.testing.assert_close(small_gemm(x[::2], w, config=(16, 32)), x[::2] @ w.t(), rtol=1e-4, atol=1e-4)


def test_small_gemm_refuses_what_it_cannot_do() -> None:
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match="1 <= M <= 64"):
        small_gemm(torch.randn(SMALL_GEMM_MAX_ROWS + 1, 32), w, config=(16, 32))
    with pytest.raises(ValueError, match="1 <= M <= 64"):
        small_gemm(torch.randn(2, 31), w, config=(16, 32))
    with pytest.raises(ValueError, match="rows contiguous"):
        small_gemm(torch.randn(2, 16), w.t(), config=(16, 32))


def test_block_rows_pads_to_a_tensor_core_tile() -> None:
    assert [block_rows(m) for m in (1, 2, 16, 17, 33, 64)] == [16, 16, 16, 32, 64, 64]


def test_use_small_gemm_gives_linear_layers_the_kernel_for_few_rows() -> None:
    calls: list[tuple[int, int]] = []
    prepared: list[tuple[tuple[int, ...], int]] = []

    def kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append((x.shape[0], w.shape[0]))
        return torch.nn.functional.linear(x, w, b)

    model = nn.Sequential(Linear(8, 12), Linear(12, 8, bias=False), Linear(8, 12))
    use_small_gemm(model, kernel, 4, lambda w, b, rows: prepared.append((tuple(w.shape), rows)))
    assert prepared == [((12, 8), 4), ((8, 12), 4)]  # once per distinct (shape, bias, dtype)
    x = torch.randn(4, 8)
    want = x
    for layer in model:
        want = want @ layer.weight.t() + (layer.bias if layer.bias is not None else 0)
    torch.testing.assert_close(model(x), want)
    assert calls[:3] == [(4, 12), (4, 8), (4, 12)]
    calls.clear()
    model(torch.randn(5, 8))  # more rows than it was given: nn.Linear's own path
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 17, 32, SMALL_GEMM_MAX_ROWS])
def test_cuda_small_gemm_autotuned_equals_linear_in_bf16(m: int) -> None:
    """The autotuned tile on a GPU, bf16 (tensor cores, fp32 accumulation) against cuBLAS in fp32, with a
    bias and a column count no tile divides."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(1000, 4096, generator=g) * 0.02).to("cuda", torch.bfloat16)
    b = torch.randn(1000, generator=g).to("cuda", torch.bfloat16)
    x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(small_gemm(x, w, b).float(), want, rtol=2e-2, atol=2e-2)
