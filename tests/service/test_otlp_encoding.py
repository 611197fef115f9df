"""``encode_spans`` writes exactly what the SDK's OTLP encoder writes, for every kind of span content:
resources and scopes (two providers, two tracers), remote and local parents, trace state, every
attribute type, events, links with attributes, statuses, dropped counts."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from modeserve.service.telemetry.otlp_encoding import FastOTLPSpanExporter, encode_spans


def _spans() -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    providers = [TracerProvider(resource=Resource({"service.name": "a", "modeserve.dp_rank": 3}, "https://schema/1")),
                 TracerProvider(resource=Resource({"service.name": "b"}), span_limits=SpanLimits(max_attributes=2))]
    for p in providers:
        p.add_span_processor(SimpleSpanProcessor(exporter))
    plain = providers[0].get_tracer("plain")
    scoped = providers[0].get_tracer("scoped", "1.2", "https://schema/2", {"scope.attr": True})
    remote = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("vendor", "x"), ("other", "y")]))
    attributes: dict[str, Any] = {"s": "text", "b": False, "i": 7, "f": 0.25, "strs": ("length", "stop"), "ints": [1, 2],
                  "floats": (0.5,), "bools": (True, False), "empty": (), "big": 2**62}
    with plain.start_as_current_span("root", kind=SpanKind.SERVER, attributes=attributes) as root:
        root.add_event("first token", {"n": 1})
        root.add_event("plain")
        root.set_status(Status(StatusCode.ERROR, "client went away"))
        child = scoped.start_span("child", kind=SpanKind.CLIENT, links=[Link(remote, {"why": "batch"}),
                                                                        Link(root.get_span_context())])
        child.add_link(remote)
        child.set_status(Status(StatusCode.OK))
        child.end()
    scoped.start_span("remote child", trace.set_span_in_context(NonRecordingSpan(remote)),
                      SpanKind.PRODUCER).end()
    plain.start_span("consumer", kind=SpanKind.CONSUMER, attributes={"map": {"a": 1, "b": ("x",)}}).end()
    providers[1].get_tracer("limited").start_span("dropped", attributes={"a": 1, "b": 2, "c": 3}).end()
    for value in (1, 1.0, True, 1, True):  # equal values of three types: same shape but for the type
        plain.start_span("step", attributes={"x": value, "mode": "DECODE"}).end()
    return list(exporter.get_finished_spans())


def test_same_request_as_the_sdk_encoder() -> None:
    spans = _spans()
    assert len(spans) == 10
    shapes: dict = {}
    sdk = sdk_encode_spans(spans)
    for _ in range(2):  # the second time from the shapes kept the first time
        ours = encode_spans(spans, shapes)
        assert ours == sdk
        assert ours.SerializeToString(deterministic=True) == sdk.SerializeToString(deterministic=True)
    assert len(ours.resource_spans) == 2 and len(ours.resource_spans[0].scope_spans) == 2
    assert len(shapes) == 6  # all but root and consumer (values not scalars): 3, and "step" with an int, a float, a bool


def test_exporter_sends_our_encoding() -> None:
    """The exporter's request reaches a real gRPC collector (sent as bytes) equal to the SDK's encoding."""
    spans = _spans()
    received: list[ExportTraceServiceRequest] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    exporter = FastOTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}", insecure=True)
    try:
        assert exporter.export(spans) == SpanExportResult.SUCCESS
        assert exporter.export(spans[:3]) == SpanExportResult.SUCCESS  # resource and scope blocks kept
    finally:
        exporter.shutdown()
        server.stop(0)
    assert received == [sdk_encode_spans(spans), sdk_encode_spans(spans[:3])]


def test_empty_resource_and_no_scope_as_the_sdk_encodes_them() -> None:
    """A resource without attributes or schema and a span without a scope still write their blocks."""
    context = SpanContext(0x1, 0x2, is_remote=False, trace_flags=TraceFlags(1))
    resource = Resource({})  # one object: spans are grouped by the identity of their resource
    spans = [ReadableSpan("bare", context, resource=resource, start_time=1, end_time=2),
             ReadableSpan("scoped", context, resource=resource, start_time=1, end_time=2,
                          instrumentation_scope=InstrumentationScope("s", schema_url="https://schema/3"))]
    assert encode_spans(spans) == sdk_encode_spans(spans)


def test_step_spans_written_as_bytes_equal_the_sdk_encoding() -> None:
    """The spans made every step with a test's exporter (``StepSpan``) encode as the SDK encodes them:
    with links (to local and remote contexts), under a local and a remote parent, with engine
    attributes set later; one links to a context with trace state (built as a message, in its place)."""
    from modeserve.service.telemetry.tracing import Tracing, forward_attributes

    memory = InMemorySpanExporter()
    tracing = Tracing("engine", 1, exporter=memory)
    request = tracing.start_span("request", kind=SpanKind.SERVER)
    remote = NonRecordingSpan(SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1)))
    stated = SpanContext(0xABC, 0x123, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")]))
    made = []
    for i, (parent, links) in enumerate([(request, ()), (request, (remote.get_span_context(),)),
                                         (remote, (request.get_span_context(), remote.get_span_context())),
                                         (remote, (stated,)), (request, ())]):
        span = tracing.start_step_span("modeserve.forward", parent, SpanKind.CLIENT, links,
                                       {"modeserve.forward_mode": "DECODE" if i else "EXTEND", "modeserve.batch_size": i,
                                        "modeserve.num_tokens": 7, "modeserve.dp_rank": 1})
        assert span is not None
        span.set_attributes(forward_attributes(8 if i % 2 else None, i))
        span.end()
        made.append(span)
        if i == 2:
            tracing.start_span("between", kind=SpanKind.INTERNAL).end()
    request.end()
    spans = list(memory.get_finished_spans())
    assert sum(type(s).__name__ == "StepSpan" for s in spans) == 5 and len(spans) == 7
    shapes: dict = {}
    for _ in range(2):
        ours = encode_spans(spans, shapes)
        assert ours == sdk_encode_spans(spans)
    steps, sdk_spans = ours.resource_spans[0].scope_spans  # step spans share one scope object, SDK spans another
    assert [s.name for s in sdk_spans.spans] == ["between", "request"]
    assert [kv.value.int_value for s in steps.spans for kv in s.attributes if kv.key == "modeserve.batch_size"] == [
        0, 1, 2, 3, 4]  # in the order they ended, the one with a trace-stated link (a message) in its place
    assert [len(s.links) for s in steps.spans] == [0, 1, 2, 1, 0]


def test_step_records_equal_the_sdk_encoding_of_the_same_spans() -> None:
    """The OTLP path's step spans (``StepRecord``): written from their fields, they encode as the SDK
    encodes the equivalent ``ReadableSpan``s; one under a parent with trace state goes through the
    message path and keeps its place."""
    from modeserve.service.telemetry.step_record import StepBatcher, StepRecord

    batcher = StepBatcher(InMemorySpanExporter(), Resource({"service.name": "e"}), InstrumentationScope("modeserve"),
                          schedule_delay_millis=60_000, max_export_batch_size=100, max_queue_size=100)
    local = SpanContext(0xAB, 0xCD, is_remote=False, trace_flags=TraceFlags(1))
    remote = SpanContext(0xAB, 0xEF, is_remote=True, trace_flags=TraceFlags(1))
    stated = SpanContext(0xAB, 0x12, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")]))
    records = []
    for i, (parent, links) in enumerate([(local, ()), (remote, (local,)), (stated, ()), (local, (remote, local))]):
        r = StepRecord(batcher, "modeserve.forward", 100 + i, parent, SpanKind.CLIENT,
                       links, {"modeserve.forward_mode": "DECODE", "modeserve.batch_size": i})
        r.set_attributes({"modeserve.cuda_graph": bool(i % 2)})
        r.end()
        records.append(r)
    shapes: dict = {}
    for _ in range(2):
        assert encode_spans(records, shapes) == sdk_encode_spans([r.readable() for r in records])
    assert records[2].context.trace_state == stated.trace_state  # a child carries its parent's trace state
    batcher.shutdown()


def test_a_batch_of_step_records_and_sdk_spans_equals_the_sdk_encoding() -> None:
    """What the encoder keeps from one record to the next (the parent's ids, the shape) is right in a
    long batch: steps under one parent with the same attributes, then other attributes, another
    parent and back, a remote parent, links (one with trace state), a parent with trace state; SDK
    spans of another resource in between (their own group, the records' order kept)."""
    from modeserve.service.telemetry.step_record import StepBatcher, StepRecord

    batcher = StepBatcher(InMemorySpanExporter(), Resource({"service.name": "e"}), InstrumentationScope("modeserve"),
                          schedule_delay_millis=60_000, max_export_batch_size=1000, max_queue_size=1000)
    a = SpanContext(0xA1, 0xA2, is_remote=False, trace_flags=TraceFlags(1))
    b = SpanContext(0xB1, 0xB2, is_remote=True, trace_flags=TraceFlags(1))
    a_again = SpanContext(0xA1, 0xA2, is_remote=False, trace_flags=TraceFlags(1))  # equal to a, another object
    stated = SpanContext(0xC1, 0xC2, is_remote=False, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")]))
    stated_link = SpanContext(0xD1, 0xD2, is_remote=True, trace_flags=TraceFlags(1),
                              trace_state=TraceState([("x", "y")]))
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": "router"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("router")
    plan = ([(a, (), 8)] * 3 + [(a, (), 7), (a, (), 8), (b, (), 8), (b, (a,), 8), (a, (), 8), (a_again, (), 8),
            (stated, (), 8), (stated, (), 8), (a, (stated_link,), 8), (a, (b, a), 8), (a, (), 8), (b, (), 8)])
    spans: list[Any] = []
    for i, (parent, links, batch_size) in enumerate(plan):
        r = StepRecord(batcher, "modeserve.forward", 1000 + i, parent, SpanKind.CLIENT,
                       links, {"modeserve.forward_mode": "DECODE", "modeserve.batch_size": batch_size})
        r.set_attributes({"modeserve.cuda_graph": batch_size == 8})
        r.end()
        spans.append(r)
        if i % 5 == 2:
            tracer.start_span(f"request {i}", kind=SpanKind.SERVER).end()
            spans.append(memory.get_finished_spans()[-1])
    assert len(spans) > len(plan)
    shapes: dict = {}
    readable = [s.readable() if isinstance(s, StepRecord) else s for s in spans]
    for _ in range(2):
        assert encode_spans(spans, shapes) == sdk_encode_spans(readable)
    batcher.shutdown()
