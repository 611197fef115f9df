"""Transport overhead: the decode step through an in-process engine vs a remote engine process
over gRPC on loopback, with and without overlap, at several batch sizes (JSON out)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Generator

import grpc
import torch

from ...engine.config import SchedulerConfig
from ...engine.sampling_params import SamplingParams
from ..router.rank_loop import EngineLoop
from ..telemetry.tracing import Tracing


def _run_batch(loop: EngineLoop, batch_size: int, prompt_len: int, new_tokens: int,
               tracing: Tracing | None = None) -> tuple[float, float]:
    """Seconds for ``batch_size`` requests of ``new_tokens`` tokens each, submitted together (each
    with a request span, as the router makes, when ``tracing`` is on: the time then ends when every
    span of the run has been exported, so export counts in full even when it would overlap): wall
    time, and CPU time of the whole process (every thread)."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    start, start_cpu = time.perf_counter(), time.process_time()
    spans = [tracing.start_span("text_completion bench") if tracing is not None else None for _ in range(batch_size)]
    handles = [loop.submit(loop.make_request(f"b{batch_size}-{i}-{time.monotonic_ns()}",
                                             [3 + (i + j) % 200 for j in range(prompt_len)], sp), spans[i])
               for i in range(batch_size)]
    for h in handles:  # drained one request at a time: the consumer wakes rarely during decode
        while h.updates.get(timeout=300).finish_reason is None:
            pass
        if h.span is not None:
            h.span.end()
    if tracing is not None:
        tracing.flush()
    return time.perf_counter() - start, time.process_time() - start_cpu


def measure_decode(loop: EngineLoop, batch_size: int, prompt_len: int, steps: int,
                   tracing: Tracing | None = None) -> tuple[float, float]:
    """Microseconds per decode step, wall and process CPU: (time with ``steps`` more tokens - time
    with one) / steps."""
    long = _run_batch(loop, batch_size, prompt_len, steps + 1, tracing)
    short = _run_batch(loop, batch_size, prompt_len, 1, tracing)
    return (long[0] - short[0]) / steps * 1e6, (long[1] - short[1]) / steps * 1e6


def measure_decode_us(loop: EngineLoop, batch_size: int, prompt_len: int, steps: int,
                      tracing: Tracing | None = None) -> float:
    """Wall microseconds per decode step (``measure_decode``)."""
    return measure_decode(loop, batch_size, prompt_len, steps, tracing)[0]


def _local_loop(model: str, overlap: bool, engine_args: dict[str, Any]) -> EngineLoop:
    from ...engine.llm import LLM
    from ..rpc.transport import InProcessTransport

    llm = LLM(model=model, **engine_args)
    return EngineLoop(llm.scheduler, InProcessTransport(llm.runner), overlap=overlap, name="local")


def remote_engine(model: str, engine_args: dict[str, Any], threads: int) -> Generator[str, None, None]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_args.items()]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", "modeserve.service.cli", "engine", "--model", model,
                             "--host", "127.0.0.1", "--port", "0", *flags], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"engine did not start: {line!r}")
        yield f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ...engine.models.random_checkpoint import write_random_checkpoint
    from ..cli.router import connect_engine

    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(write_random_checkpoint(Path(tmp.name) / "model", args.shape))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine_args = {"page_size": 16, "max_running_requests": max(batch_sizes)}
    torch.set_num_threads(args.threads)  # the in-process engines; the remote one gets the same
    remote = remote_engine(model, engine_args, args.threads)
    address = next(remote)
    loops: dict[tuple[str, bool], EngineLoop] = {}
    for overlap in (False, True):
        loops["inprocess", overlap] = _local_loop(model, overlap, engine_args)
        loops["grpc", overlap] = connect_engine(address, SchedulerConfig(max_running_requests=max(batch_sizes)),
                                                overlap, 1024, 60)
    for loop in loops.values():
        loop.start()
    samples: dict[tuple[str, bool, int], list[float]] = {}
    for rep in range(args.repeats + 1):  # round 0 warms up; rounds interleave the configurations
        for (transport, overlap), loop in loops.items():
            for bs in batch_sizes:
                value = measure_decode_us(loop, bs, args.prompt_len, args.steps if rep else 8)
                if rep:
                    samples.setdefault((transport, overlap, bs), []).append(value)
    for loop in loops.values():
        loop.stop()
    remote.close()
    tmp.cleanup()
    rows = [{"transport": t, "overlap": o, "batch_size": bs, "us_per_decode_step": round(statistics.median(v), 1),
             "us_min_max": [round(min(v), 1), round(max(v), 1)]} for (t, o, bs), v in samples.items()]

    def us(transport: str, overlap: bool, bs: int) -> float:
        return statistics.median(samples[transport, overlap, bs])

    ratios = {f"bs{bs}": {"grpc_overlap_vs_inprocess_overlap": round(us("grpc", True, bs) / us("inprocess", True, bs), 3),
                          "grpc_overlap_vs_inprocess_sync": round(us("grpc", True, bs) / us("inprocess", False, bs), 3),
                          "grpc_sync_vs_inprocess_sync": round(us("grpc", False, bs) / us("inprocess", False, bs), 3)}
              for bs in batch_sizes}
    return {"bench": "decode-step", "model": args.model or f"random:{args.shape}", "device": "cpu",
            "torch_threads_per_engine": args.threads, "prompt_len": args.prompt_len, "decode_steps": args.steps, "repeats": args.repeats,
            "results": rows, "ratios": ratios,
            "grpc_version": grpc.__version__}
