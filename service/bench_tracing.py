"""What tracing costs: the decode step with 100% sampling (request and step spans, exported over
OTLP/gRPC to a receiver on loopback) against tracing off, on one engine, in interleaved runs.

Each traced run ends when every span it made has been exported (a flush inside its timing), so the
export is counted in full, as if it never overlapped the engine. A second untraced run per round
gives the noise floor (off vs off); ratios are also taken per round (paired), which cancels slow
drift in the machine's load. Every span made is counted and must reach the receiver.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch

from modeserve.service.bench_serving import measure_decode
from modeserve.service.engine_loop import EngineLoop
from modeserve.service.tracing import Tracing


def _receiver() -> tuple[grpc.Server, int, list[int]]:
    """A loopback OTLP trace receiver that counts the spans it is sent."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = [0]

    class Sink(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received[0] += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, received


def run(args: argparse.Namespace) -> dict[str, Any]:
    from modeserve.engine.llm import LLM
    from modeserve.engine.models.random_checkpoint import write_random_checkpoint
    from modeserve.service.transport import InProcessTransport

    if args.cpus:  # every thread of the process, and those made later, on these CPUs
        cpus = {int(c) for c in args.cpus.split(",")}
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cpus)
    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(write_random_checkpoint(Path(tmp.name) / "model", args.shape))
    torch.set_num_threads(args.threads)
    server, port, received = _receiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_TRACES_SAMPLER": "always_on"}
    on = Tracing("bench", 0, env=env)
    configs = {"tracing_off": None, "tracing_off_again": None, "tracing_on": on}
    llm = LLM(model=model, device=args.device, page_size=16, max_running_requests=args.batch_size)
    loop = EngineLoop(llm.scheduler, InProcessTransport(llm.runner), name="bench")
    loop.start()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}  # (wall, cpu) us per step
    spans_created = 0
    for rep in range(args.repeats + 1):  # round 0 warms up; each round starts one configuration later
        names = list(configs)[rep % 3:] + list(configs)[:rep % 3]
        for name in names:
            loop.tracing = configs[name]  # one engine for all: between runs no step is in flight
            steps_before = sum(loop.scheduler.stats.mode_counts.values())
            us = measure_decode(loop, args.batch_size, args.prompt_len, args.steps if rep else 8, configs[name])
            if configs[name] is not None:  # a span per request, and one per step
                spans_created += 2 * args.batch_size + sum(loop.scheduler.stats.mode_counts.values()) - steps_before
            if rep:
                samples[name].append(us)
    loop.stop()
    on.shutdown()
    server.stop(0)
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
            "us_min_max": {n: [round(min(x[0] for x in v), 1), round(max(x[0] for x in v), 1)]
                           for n, v in samples.items()},
            "spans_created": spans_created, "spans_received": received[0]}
