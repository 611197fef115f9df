"""The one-row GEMV kernel equals ``torch.nn.functional.linear``; ``choose_gemv`` gives it exactly to
the layers whose weight shape its timer chose, and ``Linear`` uses it only for one-row inputs.
Without a GPU the kernel runs in Triton's CPU interpreter with a fixed tile."""

from __future__ import annotations

import pytest
import torch
from modeserve.engine.models.linear import Linear, choose_gemv
from modeserve.kernels import ops
from modeserve.kernels.triton.gemv import gemv, gemv_add_rms_norm
from modeserve.kernels.triton.norm import add_rms_norm, rms_norm
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


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k,config", [(40, 96, (8, 32)), (300, 64, (16, 64))])
def test_gemv_add_rms_norm_equals_the_pair(n: int, k: int, config: tuple[int, int], bias: bool) -> None:
    """The last program adds the residual and normalises: ``add_rms_norm(linear(x), residual)``; the
    counter is back at zero, so a second call (the next step) merges again."""
    w, b = weights(n, k, bias, torch.float32, "cpu")
    x, residual, norm_w = torch.randn(1, k), torch.randn(1, n), torch.rand(n) + 0.5
    want_out, want_res = ops.add_rms_norm(torch.nn.functional.linear(x, w, b), residual, norm_w, 1e-6)
    counter = torch.zeros(1, dtype=torch.int32)
    for _ in range(2):
        out, res = gemv_add_rms_norm(x, w, b, residual, norm_w, 1e-6, counter, config=config)
        torch.testing.assert_close(res, want_res, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        assert counter.item() == 0
    with pytest.raises(ValueError, match="residual must be"):
        gemv_add_rms_norm(x, w, b, residual[:, :-1], norm_w, 1e-6, counter, config=config)
    with pytest.raises(ValueError, match="one int32"):
        gemv_add_rms_norm(x, w, b, residual, norm_w, 1e-6, counter.long(), config=config)


def test_gemv_refuses_what_it_cannot_do() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv(torch.randn(2, 16), w, config=(8, 16))
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv(torch.randn(1, 15), w, config=(8, 16))
    with pytest.raises(ValueError, match="rows contiguous"):
        gemv(torch.randn(1, 8), w.t(), config=(8, 16))


def test_linear_add_norm_only_through_its_gemv() -> None:
    lin, calls = Linear(16, 8, bias=False), []

    def fake(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, r: torch.Tensor, nw: torch.Tensor, eps: float,
             counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(tuple(x.shape))
        return ops.add_rms_norm(torch.nn.functional.linear(x, w, b), r, nw, eps)

    x, residual, norm_w = torch.randn(3, 16), torch.randn(3, 8), torch.rand(8)
    want = ops.add_rms_norm(torch.nn.functional.linear(x, lin.weight), residual, norm_w, 1e-5)
    for rows in (slice(0, 1), slice(0, 3)):  # without the kernel: the pair
        got = lin.forward_add_norm(x[rows], residual[rows], norm_w, 1e-5, ops.add_rms_norm)
        torch.testing.assert_close(got, (want[0][rows], want[1][rows]))
    lin.gemv, lin.gemv_add_norm = lambda x, w, b: torch.nn.functional.linear(x, w, b), fake
    for rows in (slice(0, 1), slice(0, 3)):
        got = lin.forward_add_norm(x[rows], residual[rows], norm_w, 1e-5, ops.add_rms_norm)
        torch.testing.assert_close(got, (want[0][rows], want[1][rows]))
    assert calls == [(1, 16)]  # one row only


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

    report = choose_gemv(model, fake_gemv, timer, gemv_add_norm=fake_gemv)
    assert sorted(timed) == [(8, 16), (24, 8)]
    assert report == {"8x16": {"gemv": True, "gemv_us": 1.0, "cublas_us": 2.0},
                      "24x8+bias": {"gemv": False, "gemv_us": 1.0, "cublas_us": 2.0}}
    assert model.a1.gemv is fake_gemv and model.a2.gemv is fake_gemv and model.b.gemv is None
    assert model.a1.gemv_add_norm is fake_gemv and model.b.gemv_add_norm is None
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


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2048, 2048), (2048, 8192), (4096, 4096), (4096, 14336)])
def test_gemv_add_rms_norm_is_the_unfused_pair_gpu(n: int, k: int) -> None:
    """The GEMV then the add+norm kernel (bf16), at the 1B and 8B o/down shapes. With one tile for both:
    the residual bit for bit, the normalised row to an ulp (the sum of squares is reduced by another
    number of warps). Autotuned, each launch may keep another tile (the autotuner's key holds every
    tensor's dtype: the fused launch's int32 counter makes it a key of its own), so the GEMV's sums
    round apart: the residual to two bf16 ulps of the largest output, and
    the normalised row is still the norm of that residual."""
    w, _ = weights(n, k, False, torch.bfloat16, "cuda")
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    residual = torch.randn(1, n, device="cuda").to(torch.bfloat16)
    norm_w = (torch.rand(n, device="cuda") + 0.5).to(torch.bfloat16)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    want = add_rms_norm(gemv(x, w, config=(8, 512)), residual, norm_w, 1e-5)
    for _ in range(3):
        got = gemv_add_rms_norm(x, w, None, residual, norm_w, 1e-5, counter, config=(8, 512))
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)
    y = gemv(x, w)
    got = gemv_add_rms_norm(x, w, None, residual, norm_w, 1e-5, counter)
    ulp = float(y.float().abs().max()) * 2**-7  # a bf16 ulp of the largest output, or more
    torch.testing.assert_close(got[1].float(), (y + residual).float(), rtol=0, atol=2 * ulp)
    torch.testing.assert_close(got[0], rms_norm(got[1], norm_w, 1e-5), rtol=1e-2, atol=1e-2)
    assert counter.item() == 0
