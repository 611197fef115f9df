"""OpenTelemetry traces through real servers: with a real OTLP/gRPC receiver, one trace covers client
-> router request span -> router step span -> engine forward span, with gen_ai attributes on the
request and the forward mode on the steps, and ``modeserve serve`` as a subprocess exports one trace
(and its /metrics match ModelInfo's per-mode statistics); in memory, an in-process serve labels every
step's forward span by its mode. Configuration from the environment and context propagation are in
``test_tracing_config``; request-step links in ``test_tracing_links``.
"""

from __future__ import annotations

import time
from concurrent import futures
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry import trace

from modeserve.engine.config import EngineConfig, SchedulerConfig
from modeserve.engine.models.loader import open_checkpoint
from modeserve.engine.runner.model_runner import ModelRunner
from modeserve.proto.v1 import generate_pb2, generate_pb2_grpc
from modeserve.service.rpc.engine_server import create_engine_server
from modeserve.service.router.remote import RemoteRouterConfig, start_remote_router
from modeserve.service.telemetry.tracing import Tracing


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP trace collector: keeps every span it is sent, with its resource."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Any]] = []

    def Export(self, request: Any, context: Any) -> Any:
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                self.spans.extend((resource, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def attrs(span: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in span.attributes}


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    rec = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "modeserve-test")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    yield rec
    server.stop(0)


def test_one_trace_from_client_to_engine(receiver: Receiver, tiny_model: Path) -> None:
    cfg = EngineConfig.from_kwargs(model=str(tiny_model), page_size=4, kv_cache_tokens=2048)
    runner = ModelRunner(cfg.runner, open_checkpoint(tiny_model))
    engine = create_engine_server(runner, "127.0.0.1:0", model_path=str(tiny_model), dp_rank=2)
    app = start_remote_router("127.0.0.1:0", [f"127.0.0.1:{engine.port}"], None, RemoteRouterConfig(SchedulerConfig()))
    client_tracer = TracerProvider().get_tracer("test-client")  # the client's own SDK, not exported
    with client_tracer.start_as_current_span("client call") as client_span:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(client_span))
    stub = generate_pb2_grpc.GenerateStub(grpc.insecure_channel(f"127.0.0.1:{app.port}"))
    req = generate_pb2.GenerateRequest(token_ids=[5, 6, 7, 8, 9],
                                       sampling=generate_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True))
    tokens = [t for msg in stub.Generate(req, metadata=list(carrier.items())) for t in msg.token_ids]
    assert len(tokens) == 4
    app.stop(grace=1)  # flushes the router's spans
    engine.stop(1)
    deadline = time.time() + 10
    count = lambda name: sum(1 for _, s in receiver.spans if s.name == name)  # noqa: E731
    while time.time() < deadline and not 0 < count("modeserve.step") <= count("modeserve.forward"):
        time.sleep(0.05)  # the engine's provider exports on its batch timer, maybe in several batches
    spans = {s.name.split(" ")[0]: (r, s) for r, s in receiver.spans}
    trace_id = client_span.get_span_context().trace_id.to_bytes(16, "big")
    (res_req, request), (_, step) = spans["text_completion"], spans["modeserve.step"]
    forward = [s for _, s in receiver.spans if s.name == "modeserve.forward"]
    assert request.trace_id == trace_id and request.parent_span_id == client_span.get_span_context().span_id.to_bytes(8, "big")
    a = attrs(request)
    assert a["gen_ai.request.model"] and a["gen_ai.usage.input_tokens"] == 5 and a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a["gen_ai.server.time_to_first_token"] > 0
    assert res_req["service.name"] == "modeserve-test" and res_req["deployment.environment"] == "ci"
    # every step of this request is in its trace: router step spans under the request span, engine
    # forward spans under the step spans, and the request span links to its steps
    steps = [s for _, s in receiver.spans if s.name == "modeserve.step"]
    assert len(steps) >= 4 and all(s.trace_id == trace_id and s.parent_span_id == request.span_id for s in steps)
    assert {attrs(s)["modeserve.forward_mode"] for s in steps} >= {"EXTEND", "DECODE"}
    assert {bytes(l.span_id) for l in request.links} == {s.span_id for s in steps}
    step_ids = {s.span_id for s in steps}
    assert len(forward) == len(steps) and all(f.trace_id == trace_id and f.parent_span_id in step_ids for f in forward)
    fa = attrs(forward[-1])
    assert fa["modeserve.forward_mode"] == "DECODE" and fa["modeserve.dp_rank"] == 2 and fa["modeserve.batch_size"] == 1
    assert fa["modeserve.cuda_graph"] is False and fa["modeserve.padded_batch_size"] == 1 and fa["modeserve.num_tokens"] == 1
    assert attrs(step)["modeserve.batch_size"] == 1


def test_step_spans_by_mode_in_memory(tiny_model: Path) -> None:
    """One request prefilled in chunks then decoded (EXTEND -> DECODE), a second arriving while it
    decodes (a MIXED step): every step is one forward span labelled by its mode (the engine is in the
    router's process, so the scheduler's step span is the forward span)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from modeserve.service.rpc.client import GenerateClient
    from modeserve.service.rpc.engine_process import read_addresses
    from modeserve.service.router.in_process import start_serve

    exporter = InMemorySpanExporter()
    app = start_serve("127.0.0.1:0", str(tiny_model), tracing=Tracing("router", 0, env={}, exporter=exporter),
                      chunked_prefill_size=8, enable_mixed=True, max_prefill_ratio=0.9, page_size=4)
    client = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        stream = client.stream(token_ids=list(range(3, 23)), max_new_tokens=40, ignore_eos=True)
        first = next(iter(stream))  # decoding now
        second = client.generate(token_ids=list(range(30, 42)), max_new_tokens=3, ignore_eos=True)
        rest = [t for msg in stream for t in msg.token_ids]
        assert len(first.token_ids) + len(rest) == 40 and len(second.token_ids) == 3
    finally:
        client.close()
        app.stop(grace=1)
    spans = exporter.get_finished_spans()
    steps = [s for s in spans if s.name == "modeserve.step"]
    forwards = [s for s in spans if s.name == "modeserve.forward"]
    stats = app.loops[0].scheduler.stats.get_stats()["mode_distribution"]
    count = lambda ss: {m: sum(1 for s in ss if s.attributes["modeserve.forward_mode"] == m) for m in stats}  # noqa: E731
    assert not steps and count(forwards) == stats
    assert all(s.attributes["modeserve.cuda_graph"] is False and "modeserve.padded_batch_size" in s.attributes
               for s in forwards)
    assert stats["EXTEND"] >= 3 and stats["MIXED"] >= 1 and stats["DECODE"] > 30  # chunks of 8 over 20 tokens
    requests = [s for s in spans if s.name.startswith("text_completion")]
    assert len(requests) == 2 and all(s.attributes["gen_ai.usage.output_tokens"] in (40, 3) for s in requests)
    mixed = [s for s in forwards if s.attributes["modeserve.forward_mode"] == "MIXED"]
    assert all(s.attributes["modeserve.batch_size"] == 2 for s in mixed)
    assert all(len(s.links) == 1 for s in mixed)  # the other request of the step


def test_serve_process_exports_one_trace_and_metrics(receiver: Receiver, tiny_model: Path, tmp_path: Path) -> None:
    """``modeserve serve`` as a subprocess with OTEL_EXPORTER_OTLP_ENDPOINT (its engine a process of
    its own): the client's span is the parent of the request span, under which are the router's step
    spans, under which are the engine's forward spans, labelled by their modes; /metrics scraped while requests
    run, and after, matches the per-mode statistics ModelInfo reports. (Once, on an overloaded
    machine, the process had not exited 30 s after SIGTERM; a process that hangs now leaves every
    thread's stack in the failure.)"""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from modeserve.service.rpc.client import GenerateClient
    from modeserve.service.rpc.engine_process import read_addresses
    from tests.service.test_metrics import by_mode, scrape

    proc = subprocess.Popen([sys.executable, "-m", "modeserve.service.cli", "serve", "--model", str(tiny_model),
                             "--host", "127.0.0.1", "--port", "0", "--no-http", "--metrics-port", "0",
                             "--chunked-prefill-size", "8", "--enable-mixed"],
                            stdout=subprocess.PIPE, stderr=(tmp_path / "stderr").open("w"), text=True,
                            env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    try:
        announced = read_addresses(proc, "serve", 300, "metrics")
        address, metrics_port = announced["grpc"], int(announced["metrics"].rsplit(":", 1)[1])
        client_tracer = TracerProvider().get_tracer("test-client")
        with client_tracer.start_as_current_span("client call") as client_span:
            carrier: dict[str, str] = {}
            TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(client_span))
        stub = generate_pb2_grpc.GenerateStub(grpc.insecure_channel(address))
        req = generate_pb2.GenerateRequest(token_ids=list(range(3, 30)),
                                           sampling=generate_pb2.SamplingParams(max_new_tokens=220, ignore_eos=True))
        during: list[dict] = []
        streaming = threading.Event()

        def scrape_while_running() -> None:
            streaming.wait(10)
            while streaming.is_set():
                during.append(scrape(metrics_port))
                time.sleep(0.01)

        scraper = threading.Thread(target=scrape_while_running)
        scraper.start()
        tokens: list[int] = []
        for msg in stub.Generate(req, metadata=list(carrier.items())):
            tokens += msg.token_ids
            streaming.set()
        streaming.clear()
        scraper.join()
        assert len(tokens) == 220
        client = GenerateClient(address)
        info = {m.mode: m.steps for m in client.model_info().mode_stats}
        client.close()
        after = by_mode(scrape(metrics_port), "modeserve_forward_steps_total", dp_rank="0")
        assert after == {m: float(n) for m, n in info.items()} and info["EXTEND"] >= 4
        mids = [by_mode(d, "modeserve_forward_steps_total", dp_rank="0").get("DECODE", 0) for d in during]
        assert any(0 < m < after["DECODE"] for m in mids), mids  # scraped mid-run: counters were moving
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to stderr
            proc.wait(timeout=30)
            raise AssertionError("no exit 30 s after SIGTERM:\n" + (tmp_path / "stderr").read_text()[-20000:])
        assert code == 0, (tmp_path / "stderr").read_text()[-5000:]
    trace_id = client_span.get_span_context().trace_id.to_bytes(16, "big")
    mine = [s for _, s in receiver.spans if s.trace_id == trace_id]
    request = next(s for s in mine if s.name.startswith("text_completion"))
    assert request.parent_span_id == client_span.get_span_context().span_id.to_bytes(8, "big")
    steps = [s for s in mine if s.name == "modeserve.step"]  # the router's, under the request span
    forwards = [s for s in mine if s.name == "modeserve.forward"]  # the engine process's, under the steps
    modes = [attrs(s)["modeserve.forward_mode"] for s in forwards]
    assert modes.count("EXTEND") == info["EXTEND"] and modes.count("DECODE") == info["DECODE"]
    assert len(steps) == len(forwards) and all(s.parent_span_id == request.span_id for s in steps)
    assert {s.parent_span_id for s in forwards} == {s.span_id for s in steps}


def test_verify_step_spans_say_drafts_and_kept(tiny_model: Path) -> None:
    """n-gram drafting in process: each TARGET_VERIFY forward span carries its drafts and how many the
    target kept; over all of them they add up to the statistics' counts."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from modeserve.service.rpc.client import GenerateClient
    from modeserve.service.router.in_process import start_serve
    from tests.engine.test_speculative import PROMPTS

    exporter = InMemorySpanExporter()
    app = start_serve("127.0.0.1:0", str(tiny_model), tracing=Tracing("router", 0, env={}, exporter=exporter),
                      page_size=4, speculative_algorithm="ngram")
    client = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        outs = [client.generate(token_ids=p, max_new_tokens=16, ignore_eos=True) for p in PROMPTS[:4]]
        assert all(len(o.token_ids) == 16 for o in outs)
    finally:
        client.close()
        app.stop(grace=1)
    verifies = [s.attributes for s in exporter.get_finished_spans() if s.name == "modeserve.forward"
                and s.attributes["modeserve.forward_mode"] == "TARGET_VERIFY"]
    spec = app.loops[0].scheduler.stats.get_stats()["speculative"]
    assert len(verifies) == spec["verify_steps"] > 0
    assert sum(a["modeserve.spec.draft_tokens"] for a in verifies) == spec["draft_tokens"]
    assert sum(a["modeserve.spec.accepted_tokens"] for a in verifies) == spec["accepted_tokens"] > 0


def test_split_prefill_spans_say_their_layers(tiny_model: Path) -> None:
    """A long prompt arriving while others decode: its SPLIT_PREFILL forward spans say their layer ranges,
    which tile the model's layers once."""
    import threading

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from modeserve.service.rpc.client import GenerateClient
    from modeserve.service.router.in_process import start_serve
    from tests.engine.tiny_models import COMMON

    exporter = InMemorySpanExporter()
    app = start_serve("127.0.0.1:0", str(tiny_model), tracing=Tracing("router", 0, env={}, exporter=exporter),
                      page_size=4, enable_split_prefill=True, split_prefill_min_tokens=40, split_prefill_token_budget=40)
    client = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        decoding = threading.Thread(target=client.generate, kwargs=dict(token_ids=[5, 6, 7], max_new_tokens=200,
                                                                        ignore_eos=True))
        decoding.start()
        while not app.loops[0].scheduler.stats.mode_counts["DECODE"]:
            time.sleep(0.01)
        out = client.generate(token_ids=list(range(10, 70)), max_new_tokens=4, ignore_eos=True)
        assert len(out.token_ids) == 4
        decoding.join()
    finally:
        client.close()
        app.stop(grace=1)
    splits = [s.attributes for s in exporter.get_finished_spans() if s.name == "modeserve.forward"
              and s.attributes["modeserve.forward_mode"] == "SPLIT_PREFILL"]
    layers = sorted((a["modeserve.split.layer_begin"], a["modeserve.split.layer_end"]) for a in splits)
    assert layers == [(i, i + 1) for i in range(COMMON["num_hidden_layers"])]  # 60 tokens, budget 40: a layer a slice
