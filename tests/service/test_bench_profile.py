"""The profile tables of ``bench latency --profile-steps``: device time counts each kernel once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from modeserve.service.bench.profile import _profiler, _rows


def _event(key: str, device_type: DeviceType, device_us: float, cpu_us: float) -> SimpleNamespace:
    return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=device_us,
                           self_cpu_time_total=cpu_us, count=2)


def test_device_rows_leave_out_host_ops_that_launched_the_kernels() -> None:
    # as torch reports it: the host op and the runtime call carry the device time of the kernel they
    # launched, and the kernel has its own row
    events = [_event("aten::mm", DeviceType.CPU, 90.0, 12.0), _event("cuLaunchKernelEx", DeviceType.CPU, 90.0, 4.0),
              _event("nvjet_gemm", DeviceType.CUDA, 90.0, 0.0), _event("rms_norm_kernel", DeviceType.CUDA, 10.0, 0.0),
              _event("<forward op>", DeviceType.CPU, 0.0, 30.0)]
    prof = SimpleNamespace(key_averages=lambda: events)
    device = _rows(prof, 2, on_cuda=True, device_side=True)
    assert [(r["name"], r["us_per_step"], r["calls_per_step"]) for r in device] == [
        ("nvjet_gemm", 45.0, 1.0), ("rms_norm_kernel", 5.0, 1.0)]
    host = _rows(prof, 2, on_cuda=True, device_side=False)
    assert [r["name"] for r in host] == ["aten::mm", "cuLaunchKernelEx"]  # "<...>" python frames left out
    # without a device the ops are the kernels: their (host) time is the device-side table
    assert [r["name"] for r in _rows(prof, 2, on_cuda=False, device_side=True)] == ["aten::mm", "cuLaunchKernelEx"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profiled_matmul_counts_its_kernel_once() -> None:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with _profiler() as prof:
        start.record()
        for _ in range(4):
            a @ a
        end.record()
        torch.cuda.synchronize()
    rows = _rows(prof, 4, on_cuda=True, device_side=True)
    assert rows and not any(r["name"].startswith(("aten::", "cu")) for r in rows), rows
    per_matmul_us = start.elapsed_time(end) * 1e3 / 4
    assert 0.5 * per_matmul_us < sum(r["us_per_step"] for r in rows) <= 1.05 * per_matmul_us
