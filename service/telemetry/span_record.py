"""A span as the serving process keeps it — a record of facts — and how the SDK makes it.

The hot paths (a step a millisecond, a request's start and end) only fill records: ids, times,
attributes, links. A span is made from a record when it has ended, by ``SdkSink`` (the SDK's
tracer, given the record's ids through ``RecordedIds``, its times and its parent), in this process
(tests) or in the export process (``export_process``), which keeps the SDK's cost off the serving
process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider, sampling
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState


@dataclass(slots=True)
class SpanRecord:
    """One span's facts. ``context`` is its own (ids, sampled flag, trace state); ``parent`` the
    context it is a child of (None: a root span); times in ns since the epoch (``end_time`` 0 while
    it runs). Only a sampled record is ever made into a span."""

    name: str
    kind: SpanKind
    context: SpanContext
    parent: SpanContext | None
    start_time: int
    attributes: dict[str, Any]
    links: list[SpanContext] = field(default_factory=list)
    end_time: int = 0
    error: str | None = None  # the status description of a span that failed

    @property
    def sampled(self) -> bool:
        return self.context.trace_flags.sampled

    @property
    def recording(self) -> bool:
        """Sampled and not yet ended: attributes and links still count."""
        return self.end_time == 0 and self.sampled

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        if self.recording:
            self.attributes.update(attributes)

    def set_error(self, description: str) -> None:
        if self.recording:
            self.error = description


Wire = tuple[Any, ...]  # a record as plain values (pickled about ten times faster than the SDK's types)


def _context_to_wire(ctx: SpanContext) -> Wire:
    return ctx.trace_id, ctx.span_id, ctx.is_remote, int(ctx.trace_flags), tuple(ctx.trace_state.items())


def _context_from_wire(w: Wire) -> SpanContext:
    return SpanContext(w[0], w[1], w[2], TraceFlags(w[3]), TraceState(list(w[4])))


def to_wire(r: SpanRecord) -> Wire:
    return (r.name, r.kind.value, _context_to_wire(r.context), _context_to_wire(r.parent) if r.parent else None,
            r.start_time, r.attributes, [_context_to_wire(c) for c in r.links], r.end_time, r.error)


def from_wire(w: Wire) -> SpanRecord:
    return SpanRecord(w[0], SpanKind(w[1]), _context_from_wire(w[2]), _context_from_wire(w[3]) if w[3] else None,
                      w[4], w[5], [_context_from_wire(c) for c in w[6]], w[7], w[8])


class RecordedIds(IdGenerator):
    """The ids of the record being made (the SDK asks its id generator for them)."""

    def __init__(self) -> None:
        self.trace_id = 0
        self.span_id = 0

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        return self.span_id

    def is_trace_id_random(self) -> bool:
        return True  # records' trace ids come from the SDK's random generator


class SdkSink:
    """Makes SDK spans from ended records, in the calling thread, and hands them to ``processor``
    (which exports them). The provider keeps every span: a record was sampled when it started."""

    def __init__(self, resource: Resource, processor: SpanProcessor) -> None:
        self._ids = RecordedIds()
        self._provider = TracerProvider(resource=resource, sampler=sampling.ALWAYS_ON, id_generator=self._ids)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("modeserve")
        self._lock = threading.Lock()  # the ids are handed over through ``_ids``: one span at a time

    def emit(self, record: SpanRecord) -> None:
        parent = trace.set_span_in_context(NonRecordingSpan(record.parent)) if record.parent else Context()
        links = [Link(ctx) for ctx in record.links]
        with self._lock:
            self._ids.trace_id, self._ids.span_id = record.context.trace_id, record.context.span_id
            span = self._tracer.start_span(record.name, parent, record.kind, record.attributes, links,
                                           record.start_time)
        if record.error is not None:
            span.set_status(Status(StatusCode.ERROR, record.error))
        span.end(record.end_time)

    def flush(self) -> None:
        self._provider.force_flush()

    def shutdown(self) -> None:
        self._provider.shutdown()
