"""The decode step of a rank loop timed by the requests it serves (bench tracing), and an engine
server process on loopback (bench dp)."""

from __future__ import annotations

import os
import queue
import time
from typing import Any, Generator

from ...engine.llm import LLM
from ...engine.sampling_params import SamplingParams
from ..router.rank_loop import RankLoop
from ..router.rank_policy import FreeRunning
from ..router.request_handle import RequestHandle, TokenUpdate
from ..rpc.engine_process import EngineProcess
from ..telemetry.step_tracing import RequestTrace
from ..telemetry.tracing import Tracing


def _run_batch(loop: RankLoop, batch_size: int, prompt_len: int, new_tokens: int,
               tracing: Tracing | None = None) -> tuple[float, float]:
    """Seconds for ``batch_size`` requests of ``new_tokens`` tokens each, submitted together (each
    with a request span, as the router makes, when ``tracing`` is on: the time then ends when every
    span of the run has been exported, so export counts in full even when it would overlap): wall
    time, and CPU time of the whole process (every thread)."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    start, start_cpu = time.perf_counter(), time.process_time()
    spans = [tracing.start("text_completion bench") if tracing is not None else None for _ in range(batch_size)]
    queues = [queue.SimpleQueue[TokenUpdate]() for _ in spans]
    handles = [RequestHandle(loop.scheduler.make_request(f"b{batch_size}-{i}-{time.monotonic_ns()}",
                                                         [3 + (i + j) % 200 for j in range(prompt_len)], sp),
                             updates=q, trace=RequestTrace(tracing, span) if tracing is not None and span is not None else None)
               for i, (span, q) in enumerate(zip(spans, queues))]
    for h in handles:
        loop.submit(h)
    for h, q in zip(handles, queues):  # drained one request at a time: the consumer wakes rarely during decode
        while q.get(timeout=300).finish_reason is None:
            pass
        if h.trace is not None:
            h.trace.end()
    if tracing is not None:
        tracing.flush()
    return time.perf_counter() - start, time.process_time() - start_cpu


def measure_decode(loop: RankLoop, batch_size: int, prompt_len: int, steps: int,
                   tracing: Tracing | None = None) -> tuple[float, float]:
    """Microseconds per decode step, wall and process CPU: (time with ``steps`` more tokens - time
    with one) / steps."""
    long = _run_batch(loop, batch_size, prompt_len, steps + 1, tracing)
    short = _run_batch(loop, batch_size, prompt_len, 1, tracing)
    return (long[0] - short[0]) / steps * 1e6, (long[1] - short[1]) / steps * 1e6


def measure_decode_us(loop: RankLoop, batch_size: int, prompt_len: int, steps: int,
                      tracing: Tracing | None = None) -> float:
    """Wall microseconds per decode step (``measure_decode``)."""
    return measure_decode(loop, batch_size, prompt_len, steps, tracing)[0]


def local_rank(model: str, engine_args: dict[str, Any], max_in_flight: int = 2) -> RankLoop:
    """A rank over an engine in this process (not started)."""
    llm = LLM(model=model, **engine_args)
    return RankLoop("local", llm.scheduler, llm.runner, FreeRunning(max_in_flight))


def remote_engine(model: str, engine_args: dict[str, Any], threads: int) -> Generator[str, None, None]:
    """The address of a ``modeserve engine`` child of ``threads`` torch threads, stopped on close."""
    engine = EngineProcess(model, engine_args, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    try:
        yield engine.address
    finally:
        engine.stop()
