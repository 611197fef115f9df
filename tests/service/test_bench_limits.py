"""The roofline model the GPU benchmarks divide by, checked against the Llama 3.1 8B arithmetic done
by hand from its published shape."""

from __future__ import annotations

import pytest
import torch

from modeserve.engine.models.llama import LlamaForCausalLM
from modeserve.engine.models.model_config import parse_model_config
from modeserve.engine.models.random_checkpoint import PRESETS
from modeserve.service.bench.limits import Roofline


def test_llama_8b_roofline_by_hand() -> None:
    mc = parse_model_config(PRESETS["llama-3.1-8b"])
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(mc).parameters())
    roof = Roofline(mc, params, 2, kv_bytes_per_token=2 * 32 * 8 * 128 * 2, bandwidth=4e12, flops=8e14)
    h, i, v, kv = 4096, 14336, 128256, 1024
    per_layer = h * h + 2 * kv * h + h * h + 3 * h * i  # q, k+v, o, gate+up+down
    assert roof.matmul_params == pytest.approx(32 * per_layer + v * h, rel=1e-4)  # + LM head; embedding is a lookup
    ctx = [1000, 3000]
    assert roof.decode_step_bytes(ctx) == pytest.approx(2 * (32 * per_layer + v * h) + 131072 * 4000, rel=1e-4)
    assert roof.decode_step_seconds(ctx) == pytest.approx(roof.decode_step_bytes(ctx) / 4e12)  # bandwidth-bound
    assert roof.decode_step_seconds_by_op(ctx) == pytest.approx(roof.decode_step_seconds(ctx))  # matmuls too
    big = [1000] * 256  # batch 256: the matmuls are FLOP-bound (2 * 7.5e9 * 256 / 8e14 s > 15 GB / 4e12 B/s)
    matmul_s = 2 * (32 * per_layer + v * h) * 256 / 8e14
    assert roof.decode_step_seconds_by_op(big) == pytest.approx(matmul_s + 131072 * 256000 / 4e12, rel=1e-4)
    assert roof.decode_step_seconds(big) == pytest.approx(roof.decode_step_bytes(big) / 4e12)  # one kernel: bytes
    n = 4096
    by_hand = 2 * 32 * per_layer * n + 2 * 2 * 32 * 32 * 128 * n * (n + 1) / 2 + 2 * v * h
    assert roof.prefill_flops([n]) == pytest.approx(by_hand, rel=1e-4)


@pytest.mark.gpu
def test_linear_report_gpu() -> None:
    """Every distinct weight shape once, with how often a step calls it; no layer beats its bound.

    The bound is taken from the H200's data-sheet peaks (4.8 TB/s HBM, 989 TFLOP/s dense bf16), not
    from rates measured here: the GPU tests run in parallel, and rates measured on a shared GPU came out
    low (a 440 TFLOP/s matmul rate once made a 43 µs GEMM look 1.59x faster than its bound)."""
    from torch import nn

    from modeserve.service.bench.linear import linear_report

    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 4096, bias=False),
                          nn.Linear(4096, 14336, bias=False)).to(dev, torch.bfloat16)
    report = linear_report(model, 256, 4.8e12, 989e12)
    assert sorted(report) == ["14336x4096", "4096x4096"]
    assert report["4096x4096"]["calls_per_step"] == 2 and report["14336x4096"]["calls_per_step"] == 1
    for shape, row in report.items():
        n, k = map(int, shape.split("x"))
        assert row["bound_us"] == pytest.approx(max(2 * n * k / 4.8e12, 2 * 256 * n * k / 989e12) * 1e6, abs=0.01)
        assert 0 < row["ratio"] <= 1.0, row
        assert set(row["split_k_us"]) == {"2", "4"} and all(t > 0 for t in row["split_k_us"].values()), row


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_split_k_linear_is_the_product(splits: int) -> None:
    from modeserve.service.bench.linear import split_k_linear

    g = torch.Generator().manual_seed(splits)
    x, w = torch.randn(5, 64, generator=g), torch.randn(24, 64, generator=g)
    torch.testing.assert_close(split_k_linear(x, w, splits), (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of splits"):
        split_k_linear(x[:, :63], w[:, :63], 2)
