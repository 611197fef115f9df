"""The clock sampler of the benchmarks: its summary of nvidia-smi rows, the child process's life, and
(on a GPU) the real nvidia-smi."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import torch

from modeserve.service.bench import clocks as bench_clocks
from modeserve.service.bench.clocks import ClockSampler, summarize

# rows as `nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active
# --format=csv,noheader,nounits` prints them (two seen on an H200 at its power cap)
CAPPED = "1470, 1980, 693.01, 700.00, 0x0000000000000004"
CAPPED_2 = "1500, 1980, 690.43, 700.00, 0x0000000000000004"
FREE = "1980, 1980, 126.27, 700.00, 0x0000000000000000"
HOT = "1200, 1980, 500.00, 700.00, 0x0000000000000040"
UNKNOWN = "[N/A], 1980, [N/A], 700.00, [N/A]"


def test_summary_of_rows() -> None:
    s = summarize([CAPPED + "\n", FREE, CAPPED_2, UNKNOWN, "garbage line"])
    assert s == {"samples": 4, "sm_mhz_median": 1500.0, "sm_mhz_min": 1470.0, "sm_mhz_max_rated": 1980.0,
                 "power_w_median": 690.43, "power_w_max": 693.01, "power_limit_w": 700.0, "power_capped_share": 0.667,
                 "thermal_or_hw_slowdown_share": 0.0}


def test_thermal_slowdown_is_told_apart_from_the_power_cap() -> None:
    s = summarize([HOT, FREE])
    assert s is not None and s["power_capped_share"] == 0.0 and s["thermal_or_hw_slowdown_share"] == 0.5


def test_no_clock_reading_is_no_summary() -> None:
    assert summarize([]) is None
    assert summarize([UNKNOWN]) is None


def test_cpu_device_samples_nothing() -> None:
    with ClockSampler(torch.device("cpu")) as clocks:
        pass
    assert clocks.summary is None


def test_missing_program_samples_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_clocks, "gpu_id", lambda device: "GPU-0")
    with ClockSampler(torch.device("cpu"), program="no-such-nvidia-smi-here") as clocks:
        pass
    assert clocks.summary is None


def test_child_is_asked_for_the_gpu_and_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for nvidia-smi (none on CPU machines) that records its arguments and prints a row
    every 20 ms until killed: the sampler passes the GPU's id, the query and the interval, collects
    the rows printed inside the block, and leaves no child running."""
    argv_file, pid_file = tmp_path / "argv", tmp_path / "pid"
    fake = tmp_path / "fake-smi"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {argv_file}\necho $$ > {pid_file}\n"
                    f"while true; do echo '{CAPPED}'; sleep 0.02; done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(bench_clocks, "gpu_id", lambda device: "GPU-1234")
    with ClockSampler(torch.device("cpu"), interval_ms=20, program=str(fake)) as clocks:
        time.sleep(0.3)
    assert clocks.summary is not None
    assert clocks.summary["samples"] >= 3 and clocks.summary["power_capped_share"] == 1.0
    args = argv_file.read_text().split()
    assert "--id=GPU-1234" in args and "--loop-ms=20" in args and "--format=csv,noheader,nounits" in args
    assert "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active" in args
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # terminated and reaped
        os.kill(pid, 0)


@pytest.mark.gpu
def test_real_nvidia_smi_samples_a_busy_gpu() -> None:
    device = torch.device("cuda")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    with ClockSampler(device, interval_ms=50) as clocks:
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
    s = clocks.summary
    assert s is not None, "nvidia-smi gave no sample for this GPU's UUID"
    assert s["samples"] >= 5
    assert s["sm_mhz_max_rated"] is not None and 0 < s["sm_mhz_min"] <= s["sm_mhz_median"] <= s["sm_mhz_max_rated"]
    assert s["power_limit_w"] is not None and s["power_w_max"] is not None
    assert 0 < s["power_w_median"] <= s["power_w_max"]
