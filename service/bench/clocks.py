"""The GPU's SM clock and power while a benchmark's timed part runs, sampled by ``nvidia-smi``.

A GPU at its board power limit lowers its clocks (the "SW power cap" reason): on an H200 the
batch-256 decode step draws the whole 700 W and runs at about 1.3-1.6 GHz instead of 1.98 GHz on
some boards, which is most of the spread of that figure from machine to machine. A benchmark
reports what the clocks did next to its figure so that a slow run can be told from a slow board.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

QUERY = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "clocks_event_reasons.active")
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap
HW_SLOWDOWN = 0x8 | 0x40 | 0x80  # HW slowdown, HW thermal slowdown, HW power-brake slowdown
SW_THERMAL = 0x20


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def summarize(lines: Sequence[str]) -> dict[str, Any] | None:
    """The samples' summary: SM clock median/min against the rated maximum, median and peak power
    against the limit (median power x the step time ~ the step's energy), and the share of samples in
    which the power cap (or a thermal or hardware slowdown) held the clocks down. ``lines``:
    ``nvidia-smi --format=csv,noheader,nounits`` rows of ``QUERY``."""
    rows = [[p.strip() for p in line.split(",")] for line in lines]
    rows = [r for r in rows if len(r) == len(QUERY)]
    sm = [v for r in rows if (v := _number(r[0])) is not None]
    if not sm:
        return None
    power = [v for r in rows if (v := _number(r[2])) is not None]
    reasons = [int(r[4], 16) for r in rows if r[4].lower().startswith("0x")]

    def share(mask: int) -> float:
        return round(sum(1 for x in reasons if x & mask) / len(reasons), 3) if reasons else 0.0

    return {"samples": len(rows), "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm),
            "sm_mhz_max_rated": _number(rows[0][1]),
            "power_w_median": statistics.median(power) if power else None,
            "power_w_max": max(power) if power else None, "power_limit_w": _number(rows[0][3]), "power_capped_share": share(SW_POWER_CAP),
            "thermal_or_hw_slowdown_share": share(SW_THERMAL | HW_SLOWDOWN)}


def gpu_id(device: torch.device) -> str | None:
    """The id ``nvidia-smi --id`` takes for a torch CUDA device (its UUID: device indices differ
    under ``CUDA_VISIBLE_DEVICES``); None on CPU."""
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


class ClockSampler:
    """``with ClockSampler(device) as clocks: ...`` then ``clocks.summary`` (None on CPU, without
    ``nvidia-smi``, or when it gave no sample). Samples every ``interval_ms`` in a child process."""

    def __init__(self, device: torch.device, interval_ms: int = 100, program: str = "nvidia-smi") -> None:
        self.summary: dict[str, Any] | None = None
        self._lines: list[str] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        ident, path = gpu_id(device), shutil.which(program)
        self._argv = None if ident is None or path is None else [
            path, f"--id={ident}", f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits",
            f"--loop-ms={interval_ms}"]

    def __enter__(self) -> ClockSampler:
        if self._argv is not None:
            self._proc = subprocess.Popen(self._argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, args=(self._proc,), daemon=True)
            self._reader.start()
        return self

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._lines.append(line)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.summary = summarize(self._lines)
