"""Programmatic dependent launch: on Hopper the decoder's Triton kernels launch early and wait for
their predecessors in the kernel; a chain of them, each reading what the one before wrote, must
still compute what the torch references compute (a kernel that read before its wait would see stale
data). Off CUDA (and in Triton's interpreter) PDL is off."""

from __future__ import annotations

import pytest
import torch
from modeserve.kernels import ops
from modeserve.kernels.triton import argmax as triton_argmax
from modeserve.kernels.triton import ops as triton_ops
from modeserve.kernels.triton.gemv import gemv
from modeserve.kernels.triton.pdl import _pdl_on, pdl_args, pdl_enabled


def test_pdl_off_without_cuda() -> None:
    assert not pdl_enabled(torch.device("cpu"))
    assert pdl_args(torch.device("cpu")) == {"USE_PDL": False, "launch_pdl": False}


def _chain(x: torch.Tensor, r: torch.Tensor, ws: list[torch.Tensor], norm_w: torch.Tensor,
           triton_kernels: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layers of GEMV -> SiLU-and-mul -> residual add + RMSNorm, then the argmax of the last row."""
    for w in ws:
        if triton_kernels:
            h = gemv(x, w)
            x, r = triton_ops.add_rms_norm(triton_ops.silu_and_mul(h), r, norm_w, 1e-6)
        else:
            h = torch.nn.functional.linear(x, w)
            x, r = ops.add_rms_norm(ops.silu_and_mul(h), r, norm_w, 1e-6)
    ids = triton_argmax.argmax(x) if triton_kernels else ops.argmax(x)
    return x, r, ids


@pytest.mark.gpu
def test_pdl_chain_in_a_cuda_graph_equals_reference_gpu() -> None:
    assert pdl_enabled(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (9, 0))
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, layers = 1024, 24
    ws = [torch.randn(2 * hidden, hidden, device="cuda", generator=g) / hidden**0.5 for _ in range(layers)]
    norm_w = torch.rand(hidden, device="cuda", generator=g) + 0.5
    x0 = torch.randn(1, hidden, device="cuda", generator=g)
    r0 = torch.randn(1, hidden, device="cuda", generator=g)
    want = _chain(x0, r0, ws, norm_w, triton_kernels=False)

    x_in, r_in = x0.clone(), r0.clone()
    eager = _chain(x_in, r_in, ws, norm_w, triton_kernels=True)  # also compiles and autotunes
    torch.testing.assert_close(eager[0], want[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(eager[2], want[2])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _chain(x_in, r_in, ws, norm_w, triton_kernels=True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[2], want[2])
    # new inputs in the same buffers: the replay reads them, not what the capture saw
    x_in.copy_(torch.randn(1, hidden, device="cuda", generator=g))
    want = _chain(x_in, r_in, ws, norm_w, triton_kernels=False)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_pdl_can_be_turned_off_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODESERVE_DISABLE_PDL", "1")
    _pdl_on.cache_clear()
    try:
        assert not pdl_enabled(torch.device("cuda"))
        x = torch.randn(1, 256, device="cuda")
        w = torch.randn(512, 256, device="cuda")
        torch.testing.assert_close(gemv(x, w), torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
    finally:
        _pdl_on.cache_clear()
