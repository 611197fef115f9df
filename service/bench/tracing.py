"""What tracing costs: the decode step with 100% sampling (request and step spans, exported over
OTLP/gRPC to a receiver on loopback, in its own process as a collector would be) against tracing
off, on one engine, in interleaved runs.

Each traced run ends when every span it made has been exported (a flush inside its timing), so the
export is counted in full, as if it never overlapped the engine. The step time is (long run - short
run) / steps, and a run's flush waits for what the export has not done yet when the last token
arrives: the request spans, which all end then, and up to ``export_process.SEND_INTERVAL`` plus the batch
processor's delay of step spans. The short run's flush has the same request spans but hardly any
step spans, so the long run's tail of step spans is charged to the steps; runs of a thousand steps
(the default) keep that tail a small share, as a server's steady export is, while 200-step runs
made it most of the measured cost (1B shape, batch 64, H200: 4.6 of 5.5%). A second untraced run per round
gives the noise floor (off vs off); ratios are also taken per round (paired), which cancels slow
drift in the machine's load. Every span made is counted and must reach the receiver.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from ...engine.python_child import python_argv
from ..rpc.grpc_server import freeze_startup_heap
from .batch import model_folder
from .decode_step import local_rank, measure_decode
from ..telemetry.step_tracing import StepTracer
from ..telemetry.tracing import Tracing

_RECEIVER = """
import queue, sys, threading
from concurrent import futures
import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
# replies at once and parses afterwards (as a collector that queues what it receives): the engine's
# flush waits for the reply, not for this process's parsing
received, inbox = [0], queue.Queue()
def count():
    while (data := inbox.get()) is not None:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(data)
        received[0] += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
def export(data, context):
    inbox.put(data)
    return trace_service_pb2.ExportTraceServiceResponse()
counter = threading.Thread(target=count)
counter.start()
server = grpc.server(futures.ThreadPoolExecutor(2))
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
    "opentelemetry.proto.collector.trace.v1.TraceService",
    {"Export": grpc.unary_unary_rpc_method_handler(
        export, response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString)})])
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
sys.stdin.read()
server.stop(0)
inbox.put(None)
counter.join()
print(received[0], flush=True)
"""


class _GcClock:
    """Garbage collections (count by generation, seconds) during the runs of each configuration:
    a traced run keeps its spans alive until the flush, which may bring full collections forward."""

    def __init__(self, names: Iterable[str]) -> None:
        self.current: str | None = None
        self.counts = {name: [0, 0, 0] for name in names}
        self.seconds = dict.fromkeys(self.counts, 0.0)
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if self.current is None:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.counts[self.current][info["generation"]] += 1
        self.seconds[self.current] += time.perf_counter() - self._started

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


class _DroppingExporter:
    """Counts the spans it is given and drops them (``--exporter none``: what making spans costs)."""

    def __init__(self) -> None:
        self.received = 0
        self._lock = threading.Lock()  # the processor's thread and a flush may export at once

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        with self._lock:
            self.received += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class _Receiver:
    """A loopback OTLP trace receiver in a process of its own that counts the spans it is sent."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(python_argv("-c", _RECEIVER), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        self.port = int(self._proc.stdout.readline())

    def close(self) -> int:
        """Stop it; the number of spans received."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.close()
        received = int(self._proc.stdout.readline())
        self._proc.wait(timeout=10)
        return received


def run(args: argparse.Namespace) -> dict[str, Any]:

    receiver = _Receiver() if args.exporter == "otlp" else None  # before the pinning below: not on its CPUs
    if args.cpus:  # every thread of the process, and those made later, on these CPUs
        cpus = {int(c) for c in args.cpus.split(",")}
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cpus)
    tmp = tempfile.TemporaryDirectory()
    folder, load_format = model_folder(args, tmp.name)
    torch.set_num_threads(args.threads)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port if receiver else 0}",
           "OTEL_TRACES_SAMPLER": "always_on"}
    dropping = _DroppingExporter()
    on = (Tracing("bench", 0, env=env) if receiver is not None else
          Tracing("bench", 0, env=env, exporter=dropping, batched=True))  # type: ignore[arg-type]
    configs = {"tracing_off": None, "tracing_off_again": None, "tracing_on": on}
    kv_tokens = args.batch_size * (args.prompt_len + args.steps + 32) + 64  # every request of a run resident
    loop = local_rank(str(folder), {"device": args.device, "page_size": 16, "max_running_requests": args.batch_size,
                                    "load_format": load_format, "kv_cache_tokens": kv_tokens})
    tracers = {name: StepTracer(t, 0, in_process=True) if t is not None else None
               for name, t in configs.items()}
    loop.start()
    freeze_startup_heap()  # as a server does once it is up: collections skip the model's objects
    # us per decode step: (wall, cpu) from the runs' times; the step loop's own mean DECODE step time
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in configs}
    stats = loop.scheduler.stats
    spans_created, traced_runs = 0, 0
    gc_clock = _GcClock(configs)
    # Round 0 warms up. The rounds go through the six orders of the three runs in a cycle where, every
    # six rounds, each run comes first, second and third twice and right after each other run three
    # times (never after itself): what a run leaves behind (a collection to do, caches) weighs alike.
    orders = list(itertools.permutations(configs))
    for rep in range(args.repeats + 1):
        for name in orders[(0, 1, 5, 2, 3, 4)[rep % 6]]:
            loop.tracer = tracers[name]  # one engine for all: between runs no step is in flight
            steps_before = sum(stats.mode_counts.values())
            decodes_before, decode_seconds_before = stats.mode_counts["DECODE"], stats.mode_seconds["DECODE"]
            gc_clock.current = name if rep else None
            us = measure_decode(loop, args.batch_size, args.prompt_len, args.steps if rep else 8, configs[name])
            gc_clock.current = None
            if configs[name] is not None:  # a span per request, and one per step
                spans_created += 2 * args.batch_size + sum(stats.mode_counts.values()) - steps_before
                traced_runs += 2  # measure_decode: a long run and a short one
            loop_us = ((stats.mode_seconds["DECODE"] - decode_seconds_before) * 1e6 /
                       max(stats.mode_counts["DECODE"] - decodes_before, 1))
            if rep:
                samples[name].append((*us, loop_us))
            # each round's figures on stderr as it ends: a run cut short by a time limit still tells
            print(f"bench tracing round {rep} {name}: {us[0]:.1f} us/step wall, {us[1]:.1f} cpu, {loop_us:.1f} loop",
                  file=sys.stderr, flush=True)
    gc_clock.close()
    loop.stop()
    on.shutdown()
    received = receiver.close() if receiver is not None else dropping.received
    tmp.cleanup()

    def median(name: str, i: int) -> float:
        return statistics.median(s[i] for s in samples[name])

    def paired(a: str, b: str, i: int) -> float:  # each round's a vs b: slow drift in load cancels
        return round(statistics.median(x[i] / y[i] - 1 for x, y in zip(samples[a], samples[b])), 4)

    off, on_us = median("tracing_off", 0), median("tracing_on", 0)
    return {"bench": "tracing", "model": args.model or f"random:{args.shape}", "device": args.device,
            "batch_size": args.batch_size, "decode_steps": args.steps, "repeats": args.repeats, "cpus": args.cpus,
            "us_per_decode_step": {"tracing_off": round(off, 1), "tracing_on": round(on_us, 1)},
            "overhead_ratio": round(on_us / off - 1, 4),
            "noise_floor_ratio": round(median("tracing_off_again", 0) / off - 1, 4),  # both untraced
            "paired_overhead_ratio": paired("tracing_on", "tracing_off", 0),
            "paired_noise_floor_ratio": paired("tracing_off_again", "tracing_off", 0),
            "cpu_us_per_decode_step": {n: round(median(n, 1), 1) for n in configs},  # all threads
            # the step loop's own DECODE step times (no prefill, no flush: what tracing adds to a step)
            "loop_us_per_decode_step": {n: round(median(n, 2), 1) for n in configs},
            "loop_overhead_ratio": round(median("tracing_on", 2) / median("tracing_off", 2) - 1, 4),
            "loop_noise_floor_ratio": round(median("tracing_off_again", 2) / median("tracing_off", 2) - 1, 4),
            "paired_loop_overhead_ratio": paired("tracing_on", "tracing_off", 2),
            "us_min_max": {n: [round(min(x[0] for x in v), 1), round(max(x[0] for x in v), 1)]
                           for n, v in samples.items()},
            "exporter": args.exporter,
            # exporting at the end of each traced run (the flush, in the bench thread): mean per run
            # (a long and a short run per measurement: only their difference counts in the step time)
            "flush_ms_per_run": round(on.flush_seconds / max(traced_runs, 1) * 1e3, 3),
            # collections by generation [0, 1, 2] and their time, over each configuration's measured runs
            "gc_collections": gc_clock.counts, "gc_ms": {n: round(s * 1e3, 2) for n, s in gc_clock.seconds.items()},
            "spans_created": spans_created, "spans_received": received}
