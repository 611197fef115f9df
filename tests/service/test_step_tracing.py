"""``StepTracer`` and ``RequestTrace`` against the SDK's in-memory exporter: which trace a step span
is in, the links between requests and their first steps, the step span's name, kind and attributes
in and out of process, what a remote engine is sent, and what happens when nothing is sampled."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span

from modeserve.engine.forward_batch import ForwardBatch, ForwardResult
from modeserve.engine.forward_mode import ForwardMode
from modeserve.service.telemetry.step_tracing import MAX_STEP_LINKS, RequestTrace, StepTracer
from modeserve.service.telemetry.tracing import Tracing, extract, inject


def decode_batch(batch_size: int) -> ForwardBatch:
    ids = np.arange(batch_size, dtype=np.int64)
    return ForwardBatch(ForwardMode.DECODE, ids, ids, np.ones(batch_size, dtype=np.int64),
                        np.ones(batch_size, dtype=bool), ids, ids, ids)


def result(batch_size: int, bucket: int | None = None) -> ForwardResult:
    return ForwardResult(np.zeros(batch_size, dtype=np.int64), cuda_graph_bucket=bucket)


def span_id(span: Span) -> int:
    return span.get_span_context().span_id


def sampled(carrier: Mapping[str, str]) -> bool:
    return bool(int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 1)


def link_ids(span: ReadableSpan) -> list[int]:
    return [link.context.span_id for link in span.links]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def requests(tracing: Tracing, n: int) -> list[RequestTrace]:
    return [RequestTrace(tracing.start_span(f"text_completion r{i}")) for i in range(n)]


def run_step(tracer: StepTracer, traces: list[RequestTrace], bucket: int | None = None) -> ReadableSpan:
    """One step of ``traces`` started and ended; the span exported."""
    _, span = tracer.start(decode_batch(len(traces)), traces)
    assert isinstance(span, ReadableSpan)
    tracer.end(span, result(len(traces), bucket))
    return span


def test_head_stays_while_served_and_recording(exporter: InMemorySpanExporter) -> None:
    tracing = Tracing("router", 0, env={}, exporter=exporter)
    tracer = StepTracer(tracing, 0, in_process=True)
    a, b, c = requests(tracing, 3)
    parent = lambda s: s.parent.span_id  # noqa: E731
    assert parent(run_step(tracer, [a, b])) == span_id(a.span)
    assert parent(run_step(tracer, [b, a])) == span_id(a.span)  # the previous head, still served
    assert parent(run_step(tracer, [c, b])) == span_id(c.span)  # a left: the first recording one
    assert parent(run_step(tracer, [b, c])) == span_id(c.span)
    c.span.end()  # ended (a client went away) while still in a step
    assert parent(run_step(tracer, [c, b])) == span_id(b.span)
    assert all(s.context.trace_id == s.parent.trace_id for s in exporter.get_finished_spans() if s.parent)


def test_requests_and_their_first_steps_link_each_other(exporter: InMemorySpanExporter) -> None:
    tracing = Tracing("router", 0, env={}, exporter=exporter)
    tracer = StepTracer(tracing, 0, in_process=True)
    a, b = requests(tracing, 2)
    steps = [run_step(tracer, [a, b]) for _ in range(MAX_STEP_LINKS - 1)]
    assert not a.span.links and not b.span.links  # type: ignore[attr-defined]  # added in one go, at the limit
    steps += [run_step(tracer, [a, b]) for _ in range(4)]
    first = [s.context.span_id for s in steps[:MAX_STEP_LINKS]]
    assert link_ids(a.span) == link_ids(b.span) == first  # type: ignore[arg-type]
    assert all(link_ids(s) == [span_id(b.span)] for s in steps[:MAX_STEP_LINKS])  # the head is the parent
    assert all(not s.links for s in steps[MAX_STEP_LINKS:])
    a.finish()  # nothing pending: nothing added
    assert link_ids(a.span) == first  # type: ignore[arg-type]


def test_finish_adds_pending_links_once(exporter: InMemorySpanExporter) -> None:
    tracing = Tracing("router", 0, env={}, exporter=exporter)
    tracer = StepTracer(tracing, 0, in_process=False)
    (a,) = requests(tracing, 1)
    steps = [run_step(tracer, [a]) for _ in range(3)]
    assert not a.span.links  # type: ignore[attr-defined]
    a.finish()
    a.finish()
    a.span.end()
    assert link_ids(a.span) == [s.context.span_id for s in steps]  # type: ignore[arg-type]


def test_a_step_links_to_at_most_max_other_requests(exporter: InMemorySpanExporter) -> None:
    tracing = Tracing("router", 0, env={}, exporter=exporter)
    tracer = StepTracer(tracing, 0, in_process=True)
    traces = requests(tracing, MAX_STEP_LINKS + 4)
    step = run_step(tracer, traces)
    assert link_ids(step) == [span_id(t.span) for t in traces[1:MAX_STEP_LINKS + 1]]
    assert [t.step_links for t in traces] == [1] * (MAX_STEP_LINKS + 1) + [0] * 3
    late = requests(tracing, 1)[0]  # a request joining later still links to its first steps
    step = run_step(tracer, [traces[0], late])
    assert span_id(late.span) in link_ids(step) and late.step_links == 1


def test_in_process_span_is_the_forward_span(exporter: InMemorySpanExporter) -> None:
    tracing = Tracing("router", 3, env={}, exporter=exporter)
    tracer = StepTracer(tracing, 3, in_process=True)
    traces = requests(tracing, 2)
    batch = decode_batch(2)
    sent, span = tracer.start(batch, traces)
    assert sent is batch and not sent.trace_context  # the engine is here: nothing to carry
    tracer.end(span, result(2, bucket=4), end_time=span.start_time + 1000)  # type: ignore[union-attr]
    (forward,) = [s for s in exporter.get_finished_spans() if s.name == "modeserve.forward"]
    assert forward.kind == trace.SpanKind.CLIENT and forward.end_time == forward.start_time + 1000  # type: ignore[operator]
    assert dict(forward.attributes or {}) == {
        "modeserve.forward_mode": "DECODE", "modeserve.batch_size": 2, "modeserve.num_tokens": 2,
        "modeserve.dp_rank": 3, "modeserve.cuda_graph": True, "modeserve.padded_batch_size": 4}
    eager = run_step(tracer, traces)
    assert eager.attributes["modeserve.cuda_graph"] is False and eager.attributes["modeserve.padded_batch_size"] == 2  # type: ignore[index]


def test_remote_step_span_travels_in_the_batch(exporter: InMemorySpanExporter) -> None:
    tracing = Tracing("router", 0, env={}, exporter=exporter)
    tracer = StepTracer(tracing, 0, in_process=False)
    traces = requests(tracing, 1)
    sent, span = tracer.start(decode_batch(1), traces)
    assert span is not None and dict(sent.trace_context) == inject(span)
    assert trace.get_current_span(extract(sent.trace_context)).get_span_context().span_id == span_id(span)
    tracer.end(span, result(1, bucket=8))
    (step,) = [s for s in exporter.get_finished_spans() if s.name == "modeserve.step"]
    assert step.kind == trace.SpanKind.CLIENT and step.parent.span_id == span_id(traces[0].span)  # type: ignore[union-attr]
    assert "modeserve.cuda_graph" not in (step.attributes or {})  # the engine's forward span says that


def test_no_step_span_without_a_sampled_request(exporter: InMemorySpanExporter) -> None:
    tracing = Tracing("router", 0, env={"OTEL_TRACES_SAMPLER": "always_off"}, exporter=exporter)
    traces = requests(tracing, 2)
    batch = decode_batch(2)
    assert StepTracer(tracing, 0, in_process=True).start(batch, traces) == (batch, None)
    sent, span = StepTracer(tracing, 0, in_process=False).start(batch, traces)
    assert span is None and dict(sent.trace_context) == inject(traces[0].span)  # the engine samples alike
    assert not sampled(sent.trace_context)
    assert not exporter.get_finished_spans()


def test_unsampled_parent_makes_unsampled_requests_only(exporter: InMemorySpanExporter) -> None:
    """Parent-based sampling: a request whose client did not sample it makes no step span; a step
    with a sampled request too is in the sampled one's trace and links to it alone."""
    tracing = Tracing("router", 0, env={}, exporter=exporter)
    unsampled_ctx = extract({"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-00"})
    dropped = RequestTrace(tracing.start_span("text_completion dropped", unsampled_ctx))
    assert not dropped.span.is_recording()
    tracer = StepTracer(tracing, 0, in_process=False)
    batch = decode_batch(1)
    sent, span = tracer.start(batch, [dropped])
    assert span is None and dict(sent.trace_context) == inject(dropped.span) and not sampled(sent.trace_context)
    assert sent.trace_context["traceparent"].startswith(f"00-{'ab' * 16}-")
    (kept,) = requests(tracing, 1)
    step = run_step(tracer, [dropped, kept])
    assert step.parent.span_id == span_id(kept.span) and not step.links  # type: ignore[union-attr]
    assert dropped.step_links == 0 and kept.step_links == 1


def test_tracing_off_makes_nothing() -> None:
    tracing = Tracing("router", 0, env={})
    traces = [RequestTrace(tracing.start_span("text_completion"))]
    batch = decode_batch(1)
    for in_process in (True, False):
        tracer = StepTracer(tracing, 0, in_process)
        assert not tracer.enabled and tracer.start(batch, traces) == (batch, None)
        tracer.end(None, result(1))
    assert StepTracer(Tracing("router", 0, env={}, exporter=InMemorySpanExporter()), 0, False).start(
        batch, []) == (batch, None)


def test_engine_side_batch_context_round_trip(exporter: InMemorySpanExporter) -> None:
    """What the router's step sends is what the engine's forward span is a child of."""
    from modeserve.service.telemetry.step_tracing import end_forward_span, forward_span

    router = Tracing("router", 0, env={}, exporter=InMemorySpanExporter())
    engine = Tracing("engine", 0, env={}, exporter=exporter)
    sent, step = StepTracer(router, 0, in_process=False).start(decode_batch(2), requests(router, 2))
    assert step is not None
    span = forward_span(engine, dataclasses.replace(sent), 0)
    end_forward_span(span, result(2))
    (forward,) = exporter.get_finished_spans()
    assert forward.parent.span_id == span_id(step) and forward.context.trace_id == forward.parent.trace_id  # type: ignore[union-attr]
    assert forward.attributes["modeserve.padded_batch_size"] == 2  # type: ignore[index]
