"""``StepTracer`` and ``RequestTrace`` against the SDK's in-memory exporter: which trace a step span
is in, the links between requests and their first steps, the step span's name, kind and attributes
in and out of process, what a remote engine is sent, and what happens when nothing is sampled. The
spans checked are the ones the SDK made and exported from the records."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from modeserve.engine.forward_batch import ForwardBatch, ForwardResult
from modeserve.engine.forward_mode import ForwardMode
from modeserve.service.telemetry.span_record import SpanRecord
from modeserve.service.telemetry.step_tracing import MAX_STEP_LINKS, RequestTrace, StepTracer
from modeserve.service.telemetry.tracing import Tracing, extract, inject


def decode_batch(batch_size: int) -> ForwardBatch:
    ids = np.arange(batch_size, dtype=np.int64)
    return ForwardBatch(ForwardMode.DECODE, ids, ids, np.ones(batch_size, dtype=np.int64),
                        np.ones(batch_size, dtype=bool), ids, ids, ids)


def result(batch_size: int, bucket: int | None = None) -> ForwardResult:
    return ForwardResult(np.zeros(batch_size, dtype=np.int64), cuda_graph_bucket=bucket)


def span_id(span: RequestTrace | SpanRecord) -> int:
    return span.context.span_id


def sampled(carrier: Mapping[str, str]) -> bool:
    return bool(int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 1)


def link_ids(span: ReadableSpan) -> list[int]:
    return [link.context.span_id for link in span.links]


class Traced:
    """A router's tracing into an in-memory exporter, and the spans it made."""

    def __init__(self, dp_rank: int = 0, **env: str) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracing = Tracing("router", dp_rank, env=env, exporter=self.exporter)

    def requests(self, n: int) -> list[RequestTrace]:
        return [RequestTrace(self.tracing, self.tracing.start(f"text_completion r{i}")) for i in range(n)]

    def made(self, span: RequestTrace | SpanRecord) -> ReadableSpan:
        (made,) = [s for s in self.exporter.get_finished_spans() if s.context.span_id == span_id(span)]
        return made

    def run_step(self, tracer: StepTracer, traces: list[RequestTrace], bucket: int | None = None) -> ReadableSpan:
        """One step of ``traces`` started and ended; the span made of it."""
        _, span = tracer.start(decode_batch(len(traces)), traces)
        assert span is not None
        tracer.end(span, result(len(traces), bucket))
        return self.made(span)


@pytest.fixture
def traced() -> Traced:
    return Traced()


def test_head_stays_while_served_and_recording(traced: Traced) -> None:
    tracer = StepTracer(traced.tracing, 0, in_process=True)
    a, b, c = traced.requests(3)
    parent = lambda s: s.parent.span_id  # noqa: E731
    assert parent(traced.run_step(tracer, [a, b])) == span_id(a)
    assert parent(traced.run_step(tracer, [b, a])) == span_id(a)  # the previous head, still served
    assert parent(traced.run_step(tracer, [c, b])) == span_id(c)  # a left: the first recording one
    assert parent(traced.run_step(tracer, [b, c])) == span_id(c)
    c.end()  # ended (a client went away) while still in a step
    assert parent(traced.run_step(tracer, [c, b])) == span_id(b)
    spans = traced.exporter.get_finished_spans()
    assert all(s.context.trace_id == s.parent.trace_id for s in spans if s.parent)


def test_requests_and_their_first_steps_link_each_other(traced: Traced) -> None:
    tracer = StepTracer(traced.tracing, 0, in_process=True)
    a, b = traced.requests(2)
    steps = [traced.run_step(tracer, [a, b]) for _ in range(MAX_STEP_LINKS + 4)]
    a.end()
    b.end()
    first = [s.context.span_id for s in steps[:MAX_STEP_LINKS]]
    assert link_ids(traced.made(a)) == link_ids(traced.made(b)) == first
    assert all(link_ids(s) == [span_id(b)] for s in steps[:MAX_STEP_LINKS])  # the head is the parent
    assert all(not s.links for s in steps[MAX_STEP_LINKS:])
    a.end()  # again: nothing more made
    assert len([s for s in traced.exporter.get_finished_spans() if s.name == "text_completion r0"]) == 1


def test_an_ended_request_takes_no_more_links(traced: Traced) -> None:
    tracer = StepTracer(traced.tracing, 0, in_process=False)
    (a,) = traced.requests(1)
    steps = [traced.run_step(tracer, [a]) for _ in range(3)]
    a.end(error="client went away")
    _, late = tracer.start(decode_batch(1), [a])  # a step scheduled before the abort reached the rank
    assert late is None
    made = traced.made(a)
    assert link_ids(made) == [s.context.span_id for s in steps]
    assert made.status.status_code == trace.StatusCode.ERROR and made.status.description == "client went away"


def test_a_step_links_to_at_most_max_other_requests(traced: Traced) -> None:
    tracer = StepTracer(traced.tracing, 0, in_process=True)
    traces = traced.requests(MAX_STEP_LINKS + 4)
    step = traced.run_step(tracer, traces)
    assert link_ids(step) == [span_id(t) for t in traces[1:MAX_STEP_LINKS + 1]]
    assert [t.step_links for t in traces] == [1] * (MAX_STEP_LINKS + 1) + [0] * 3
    late = traced.requests(1)[0]  # a request joining later still links to its first steps
    step = traced.run_step(tracer, [traces[0], late])
    assert span_id(late) in link_ids(step) and late.step_links == 1


def test_in_process_span_is_the_forward_span() -> None:
    traced = Traced(dp_rank=3)
    tracer = StepTracer(traced.tracing, 3, in_process=True)
    traces = traced.requests(2)
    batch = decode_batch(2)
    sent, span = tracer.start(batch, traces)
    assert sent is batch and not sent.trace_context and span is not None  # the engine is here: nothing to carry
    tracer.end(span, result(2, bucket=4), end_time=span.start_time + 1000)
    forward = traced.made(span)
    assert forward.name == "modeserve.forward"
    assert forward.kind == trace.SpanKind.CLIENT and forward.end_time == forward.start_time + 1000  # type: ignore[operator]
    assert dict(forward.attributes or {}) == {
        "modeserve.forward_mode": "DECODE", "modeserve.batch_size": 2, "modeserve.num_tokens": 2,
        "modeserve.dp_rank": 3, "modeserve.cuda_graph": True, "modeserve.padded_batch_size": 4}
    assert forward.resource.attributes["modeserve.dp_rank"] == 3
    eager = traced.run_step(tracer, traces)
    assert eager.attributes["modeserve.cuda_graph"] is False and eager.attributes["modeserve.padded_batch_size"] == 2  # type: ignore[index]


def test_remote_step_span_travels_in_the_batch(traced: Traced) -> None:
    tracer = StepTracer(traced.tracing, 0, in_process=False)
    traces = traced.requests(1)
    sent, span = tracer.start(decode_batch(1), traces)
    assert span is not None and dict(sent.trace_context) == inject(span.context)
    carried = extract(sent.trace_context)
    assert carried is not None and carried.span_id == span_id(span) and carried.trace_id == span.context.trace_id
    tracer.end(span, result(1, bucket=8))
    step = traced.made(span)
    assert step.name == "modeserve.step" and step.kind == trace.SpanKind.CLIENT
    assert step.parent.span_id == span_id(traces[0])  # type: ignore[union-attr]
    assert "modeserve.cuda_graph" not in (step.attributes or {})  # the engine's forward span says that


def test_no_step_span_without_a_sampled_request() -> None:
    traced = Traced(OTEL_TRACES_SAMPLER="always_off")
    traces = traced.requests(2)
    batch = decode_batch(2)
    assert StepTracer(traced.tracing, 0, in_process=True).start(batch, traces) == (batch, None)
    sent, span = StepTracer(traced.tracing, 0, in_process=False).start(batch, traces)
    assert span is None and dict(sent.trace_context) == inject(traces[0].context)  # the engine samples alike
    assert not sampled(sent.trace_context)
    for t in traces:
        t.end()
    assert not traced.exporter.get_finished_spans()


def test_unsampled_parent_makes_unsampled_requests_only(traced: Traced) -> None:
    """Parent-based sampling: a request whose client did not sample it makes no step span; a step
    with a sampled request too is in the sampled one's trace and links to it alone."""
    tracing = traced.tracing
    unsampled_ctx = extract({"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-00"})
    dropped = RequestTrace(tracing, tracing.start("text_completion dropped", unsampled_ctx))
    assert not dropped.recording
    tracer = StepTracer(tracing, 0, in_process=False)
    batch = decode_batch(1)
    sent, span = tracer.start(batch, [dropped])
    assert span is None and dict(sent.trace_context) == inject(dropped.context) and not sampled(sent.trace_context)
    assert sent.trace_context["traceparent"].startswith(f"00-{'ab' * 16}-")
    (kept,) = traced.requests(1)
    step = traced.run_step(tracer, [dropped, kept])
    assert step.parent.span_id == span_id(kept) and not step.links  # type: ignore[union-attr]
    assert dropped.step_links == 0 and kept.step_links == 1
    dropped.end()
    assert not [s for s in traced.exporter.get_finished_spans() if s.name == "text_completion dropped"]


def test_tracing_off_makes_nothing() -> None:
    tracing = Tracing("router", 0, env={})
    traces = [RequestTrace(tracing, tracing.start("text_completion"))]
    assert not traces[0].context.is_valid and not traces[0].recording
    batch = decode_batch(1)
    for in_process in (True, False):
        tracer = StepTracer(tracing, 0, in_process)
        assert not tracer.enabled and tracer.start(batch, traces) == (batch, None)
        tracer.end(None, result(1))
    traces[0].end()
    assert StepTracer(Traced().tracing, 0, False).start(batch, []) == (batch, None)


def test_engine_side_batch_context_round_trip(traced: Traced) -> None:
    """What the router's step sends is what the engine's forward span is a child of."""
    from modeserve.service.telemetry.step_tracing import end_forward_span, forward_span

    engine = Traced()
    sent, step = StepTracer(traced.tracing, 0, in_process=False).start(decode_batch(2), traced.requests(2))
    assert step is not None
    span = forward_span(engine.tracing, dataclasses.replace(sent), 0)
    end_forward_span(engine.tracing, span, result(2))
    (forward,) = engine.exporter.get_finished_spans()
    assert forward.parent.span_id == span_id(step) and forward.context.trace_id == forward.parent.trace_id  # type: ignore[union-attr]
    assert forward.attributes["modeserve.padded_batch_size"] == 2  # type: ignore[index]
