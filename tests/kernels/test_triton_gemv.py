"""The one-row GEMV kernel equals ``torch.nn.functional.linear``; ``choose_gemv`` gives it exactly to
the layers whose weight shape it measured faster, and ``Linear`` uses it only for one-row inputs.
Without a GPU the kernel runs in Triton's CPU interpreter with a fixed tile."""

from __future__ import annotations

import pytest
import torch
from modeserve.engine.models.linear import Linear, choose_gemv
from modeserve.kernels.triton.gemv import gemv
from torch import nn


def weights(n: int, k: int, bias: bool, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return w, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k,config", [(40, 96, (8, 32)), (33, 100, (16, 64)), (7, 256, (8, 256)), (64, 64, (32, 16))])
def test_gemv_equals_linear(n: int, k: int, config: tuple[int, int], bias: bool) -> None:
    w, b = weights(n, k, bias, torch.float32, "cpu")
    x = torch.randn(1, k)
    torch.testing.assert_close(gemv(x, w, b, config=config), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_gemv_refuses_what_it_cannot_do() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv(torch.randn(2, 16), w, config=(8, 16))
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv(torch.randn(1, 15), w, config=(8, 16))
    with pytest.raises(ValueError, match="rows contiguous"):
        gemv(torch.randn(1, 8), w.t(), config=(8, 16))


class TwoShapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a1, self.a2 = Linear(16, 8, bias=False), Linear(16, 8, bias=False)  # same shape: timed once
        self.b = Linear(8, 24, bias=True)
        self.plain = nn.Linear(16, 8)  # not ours: never touched


def test_choose_gemv_follows_the_timings_and_only_for_one_row() -> None:
    model, timed, calls = TwoShapes(), [], []

    def timer(w: torch.Tensor, b: torch.Tensor | None) -> tuple[bool, float, float]:
        timed.append(tuple(w.shape))
        return (tuple(w.shape) == (8, 16), 1.0, 2.0)  # faster only for the a-shape

    def fake_gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(tuple(w.shape))
        return torch.nn.functional.linear(x, w, b)

    report = choose_gemv(model, fake_gemv, timer)
    assert sorted(timed) == [(8, 16), (24, 8)]
    assert report == {"8x16": {"gemv": True, "gemv_us": 1.0, "cublas_us": 2.0},
                      "24x8+bias": {"gemv": False, "gemv_us": 1.0, "cublas_us": 2.0}}
    assert model.a1.gemv is fake_gemv and model.a2.gemv is fake_gemv and model.b.gemv is None
    assert not hasattr(model.plain, "gemv")
    x = torch.randn(1, 16)
    torch.testing.assert_close(model.a1(x), torch.nn.functional.linear(x, model.a1.weight))
    assert calls == [(8, 16)]
    model.a1(torch.randn(3, 16))  # several rows: cuBLAS
    model.b(torch.randn(1, 8))  # not chosen
    assert calls == [(8, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (6144, 4096), (4096, 14336), (1000, 333)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gemv_equals_linear_gpu(n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    w, b = weights(n, k, bias, dtype, "cuda")
    x = torch.randn(1, k, device="cuda").to(dtype)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(gemv(x, w, b).float(), ref, rtol=tol, atol=tol * k ** 0.5)
