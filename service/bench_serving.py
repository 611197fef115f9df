"""Transport overhead: the decode step through an in-process engine vs a remote engine process
over gRPC on loopback, with and without overlap, at several batch sizes (JSON out)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Generator

import grpc

from modeserve.engine.config import SchedulerConfig
from modeserve.engine.sampling_params import SamplingParams
from modeserve.service.engine_loop import EngineLoop


def _measure(loop: EngineLoop, batch_size: int, prompt_len: int, steps: int) -> float:
    """Microseconds per decode step: from the moment every request has its first token to the end."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=steps + 1, ignore_eos=True)
    handles = [loop.submit(loop.make_request(f"b{batch_size}-{i}-{time.monotonic_ns()}",
                                             [3 + (i + j) % 200 for j in range(prompt_len)], sp))
               for i in range(batch_size)]
    first: list[float] = []
    for h in handles:
        h.updates.get(timeout=120)
        first.append(time.perf_counter())
    for h in handles:
        while h.updates.get(timeout=120).finish_reason is None:
            pass
    return (time.perf_counter() - max(first)) / steps * 1e6


def _local_loop(model: str, overlap: bool, engine_args: dict[str, Any]) -> EngineLoop:
    from modeserve.engine.llm import LLM
    from modeserve.service.transport import InProcessTransport

    llm = LLM(model=model, **engine_args)
    return EngineLoop(llm.scheduler, InProcessTransport(llm.runner), overlap=overlap, name="local")


def _remote_engine(model: str, engine_args: dict[str, Any]) -> Generator[str, None, None]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_args.items()]
    proc = subprocess.Popen([sys.executable, "-m", "modeserve.service.cli", "engine", "--model", model,
                             "--host", "127.0.0.1", "--port", "0", *flags], stdout=subprocess.PIPE, text=True)
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
    from modeserve.engine.models.random_checkpoint import write_random_checkpoint
    from modeserve.service.router_cmd import connect_engine

    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(write_random_checkpoint(Path(tmp.name) / "model", args.shape))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine_args = {"page_size": 16, "max_running_requests": max(batch_sizes)}
    rows: list[dict[str, Any]] = []
    for overlap in (False, True):
        loop = _local_loop(model, overlap, engine_args)
        loop.start()
        for bs in batch_sizes:
            _measure(loop, bs, args.prompt_len, 8)  # warm-up
            rows.append({"transport": "inprocess", "overlap": overlap, "batch_size": bs,
                         "us_per_decode_step": round(_measure(loop, bs, args.prompt_len, args.steps), 1)})
        loop.stop()
    remote = _remote_engine(model, engine_args)
    address = next(remote)
    for overlap in (False, True):
        loop, _ = connect_engine(address, SchedulerConfig(max_running_requests=max(batch_sizes)), overlap, 1024, 60)
        loop.start()
        for bs in batch_sizes:
            _measure(loop, bs, args.prompt_len, 8)
            rows.append({"transport": "grpc", "overlap": overlap, "batch_size": bs,
                         "us_per_decode_step": round(_measure(loop, bs, args.prompt_len, args.steps), 1)})
        loop.stop()
    remote.close()
    tmp.cleanup()

    def us(transport: str, overlap: bool, bs: int) -> float:
        return next(r["us_per_decode_step"] for r in rows
                    if (r["transport"], r["overlap"], r["batch_size"]) == (transport, overlap, bs))

    ratios = {f"bs{bs}": {"grpc_overlap_vs_inprocess_overlap": round(us("grpc", True, bs) / us("inprocess", True, bs), 3),
                          "grpc_overlap_vs_inprocess_sync": round(us("grpc", True, bs) / us("inprocess", False, bs), 3),
                          "grpc_sync_vs_inprocess_sync": round(us("grpc", False, bs) / us("inprocess", False, bs), 3)}
              for bs in batch_sizes}
    return {"bench": "serving", "model": args.model or f"random:{args.shape}", "device": "cpu",
            "prompt_len": args.prompt_len, "decode_steps": args.steps, "results": rows, "ratios": ratios,
            "grpc_version": grpc.__version__}
