"""What tracing costs: the decode step with 100% sampling (request, step and forward spans, exported
over OTLP/gRPC to a receiver on loopback) against tracing off, same engine, interleaved runs."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch

from modeserve.service.bench_serving import measure_decode_us
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

    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(write_random_checkpoint(Path(tmp.name) / "model", args.shape))
    torch.set_num_threads(args.threads)
    server, port, received = _receiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_TRACES_SAMPLER": "always_on"}
    on = Tracing("bench", 0, env=env)
    loops: dict[bool, EngineLoop] = {}
    for traced in (False, True):
        llm = LLM(model=model, device=args.device, page_size=16, max_running_requests=args.batch_size)
        tracing = on if traced else None
        loops[traced] = EngineLoop(llm.scheduler, InProcessTransport(llm.runner), tracing=tracing,
                                   name=f"traced={traced}")
        loops[traced].start()
    samples: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(args.repeats + 1):  # round 0 warms up
        for traced, loop in loops.items():
            us = measure_decode_us(loop, args.batch_size, args.prompt_len, args.steps if rep else 8,
                                   on if traced else None)
            if rep:
                samples[traced].append(us)
    for loop in loops.values():
        loop.stop()
    on.shutdown()  # flushes: the receiver has every span
    server.stop(0)
    tmp.cleanup()
    off_us, on_us = statistics.median(samples[False]), statistics.median(samples[True])
    return {"bench": "tracing", "model": args.model or f"random:{args.shape}", "device": args.device,
            "batch_size": args.batch_size, "decode_steps": args.steps, "repeats": args.repeats,
            "us_per_decode_step": {"tracing_off": round(off_us, 1), "tracing_on": round(on_us, 1)},
            "overhead_ratio": round(on_us / off_us - 1, 4), "spans_received": received[0]}
