"""Where a benchmark's step goes, by ``torch.profiler``: device time per kernel (kernels inside CUDA
graphs included) and, for the eager prefill, the host's time per op, which is what bounds a short
prefill when launching its kernels takes longer than running them."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch.autograd import DeviceType

from ...engine.sampling_params import SamplingParams
from .batch import add_batch, prefill, random_prompts
from .limits import sync


def _fresh_batch(llm: Any, prompts: torch.Tensor, sp: SamplingParams, seed: int) -> list[Any]:
    fresh = random_prompts(llm.model_config.vocab_size, len(prompts), prompts.shape[1], seed=seed)
    return add_batch(llm, fresh.tolist(), sp)


def _rows(prof: Any, per: int, on_cuda: bool, device_side: bool) -> list[dict[str, Any]]:
    """Profiler events by self time per ``per`` steps, largest first: device time (kernels, or ops on
    CPU where the ops are the kernels) when ``device_side``, else host time (ops and CUDA runtime calls).

    On the device side only the device's own events count: a host op's (or a runtime call's) "self
    device time" is the time of the kernels it launched, which appear again as rows of their own."""
    device = device_side and on_cuda
    rows = []
    for ev in prof.key_averages():
        if device and ev.device_type == DeviceType.CPU:
            continue
        us = ev.self_device_time_total if device else ev.self_cpu_time_total
        if us > 0 and (device or not ev.key.startswith("<")):
            rows.append({"name": ev.key[:90], "us_per_step": round(us / per, 2), "calls_per_step": round(ev.count / per, 2)})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def _profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else []))


def profile_steps(llm: Any, run: Callable[[], None]) -> dict[str, Any]:
    """Device time per step by kernel and wall time per step over the steps ``run`` makes the engine
    take (the device synced at both ends)."""
    counts = llm.scheduler.stats.mode_counts
    before = sum(counts.values())
    sync(llm.runner.device)
    with _profiler() as prof:
        start = time.perf_counter()
        run()
        sync(llm.runner.device)
        wall = time.perf_counter() - start
    steps = max(sum(counts.values()) - before, 1)
    rows = _rows(prof, steps, llm.runner.device.type == "cuda", device_side=True)
    return {"steps": steps, "wall_ms_per_step": round(wall * 1e3 / steps, 4),
            "device_ms_per_step": round(sum(r["us_per_step"] for r in rows) / 1e3, 4), "top_kernels": rows[:25]}


def decode_profile(llm: Any, prompts: torch.Tensor, sp: SamplingParams, steps: int) -> dict[str, Any]:
    """Device time per decode step by kernel and the wall time per step, over ``steps`` decode steps
    of a fresh batch of the same shape (launched as the engine serves, one step in flight)."""
    reqs = _fresh_batch(llm, prompts, sp.replace(max_new_tokens=steps + 1), seed=2)
    prefill(llm, reqs)
    on_cuda = llm.runner.device.type == "cuda"
    with _profiler() as prof:
        start = time.perf_counter()
        llm.run_until(lambda: all(r.finished for r in reqs))
        sync(llm.runner.device)
        wall = (time.perf_counter() - start) / steps
    rows = _rows(prof, steps, on_cuda, device_side=True)
    return {"steps": steps, "wall_ms_per_step": round(wall * 1e3, 4),
            "device_ms_per_step": round(sum(r["us_per_step"] for r in rows) / 1e3, 4), "top_kernels": rows[:25]}


def prefill_profile(llm: Any, prompts: torch.Tensor, sp: SamplingParams) -> dict[str, Any]:
    """The prefill of a fresh batch of the same shape, timed as the benchmark times it (``step()``
    until every request has its first token): wall time, device time by kernel, and host time by op
    (``cudaLaunchKernel``, ``cudaStreamSynchronize``, aten ops...)."""
    reqs = _fresh_batch(llm, prompts, sp.replace(max_new_tokens=1), seed=3)
    on_cuda = llm.runner.device.type == "cuda"
    sync(llm.runner.device)
    with _profiler() as prof:
        start = time.perf_counter()
        steps = prefill(llm, reqs)
        sync(llm.runner.device)
        wall = time.perf_counter() - start
    llm.run_until(lambda: all(r.finished for r in reqs))
    kernels = _rows(prof, 1, on_cuda, device_side=True)
    host = _rows(prof, 1, on_cuda, device_side=False)
    return {"steps": steps, "wall_ms": round(wall * 1e3, 3),
            "device_ms": round(sum(r["us_per_step"] for r in kernels) / 1e3, 3) if on_cuda else None,
            # the ops' own host time; the rest of wall_ms is Python between them, or the device's
            "host_op_ms": round(sum(r["us_per_step"] for r in host) / 1e3, 3),
            "top_kernels": kernels[:20], "top_host_ops": host[:20]}
