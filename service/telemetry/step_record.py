"""Step spans on the OTLP path: plain records made in the step loop, exported in batches.

With an OTLP endpoint every step makes a span, a thousand a second on a small model, and on a GPU
the step loop's host time is the whole step: what a span costs to make there is what tracing costs.
A ``StepRecord`` is a span's fields and nothing else (no SDK object, no processor call): the loop
makes it, sets its attributes, ends it into a ``StepBatcher``; the batcher's thread hands the ended
records to the exporter, whose encoder writes them as protobuf wire bytes (``otlp_encoding``). A
record becomes an SDK ``ReadableSpan`` only where one is asked for (``readable``: the encoder's
fallback for trace state, and tests). Spans that tests collect in memory stay ``StepSpan``s.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Mapping

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags

from .tracing import RANDOM_TRACE_ID, SAMPLED_FLAGS

logger = logging.getLogger(__name__)


class StepRecord:
    """One sampled step's span, a child of ``parent``: ``context``, ``set_attributes`` and ``end`` as a
    span has them. Made with what changes from step to step (its trace id, flags and trace state follow
    from its parent's, its resource and scope are its batcher's). One thread at a time touches it
    (attributes are set before the step's result comes back, ``end`` after)."""

    __slots__ = ("_context", "attributes", "batcher", "end_time", "kind", "links", "name", "parent", "span_id",
                 "start_time")

    def __init__(self, batcher: StepBatcher, name: str, span_id: int, parent: SpanContext, kind: SpanKind,
                 links: tuple[SpanContext, ...], attributes: dict[str, Any]) -> None:
        self.batcher, self.name, self.span_id, self.parent, self.kind = batcher, name, span_id, parent, kind
        self.links, self.attributes = links, attributes
        self.start_time, self.end_time = time.time_ns(), 0
        self._context: SpanContext | None = None

    @property
    def trace_id(self) -> int:
        return self.parent.trace_id

    @property
    def flags(self) -> TraceFlags:
        """Sampled, and W3C's random-trace-id flag as the parent has it."""
        return SAMPLED_FLAGS[self.parent.trace_flags & RANDOM_TRACE_ID]

    @property
    def resource(self) -> Resource:
        return self.batcher.resource

    @property
    def instrumentation_scope(self) -> InstrumentationScope:
        return self.batcher.scope

    @property
    def context(self) -> SpanContext:
        """Built when first asked for (to link to the step, or to send it as a parent)."""
        if self._context is None:
            self._context = SpanContext(self.trace_id, self.span_id, False, self.flags, self.parent.trace_state)
        return self._context

    def get_span_context(self) -> SpanContext:
        return self.context

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def end(self) -> None:
        """Once."""
        self.end_time = time.time_ns()
        self.batcher.add(self)

    def readable(self) -> ReadableSpan:
        """The same span as an SDK ``ReadableSpan``."""
        return ReadableSpan(self.name, self.context, self.parent, self.resource, dict(self.attributes), (),
                            tuple(Link(ctx) for ctx in self.links), self.kind, start_time=self.start_time,
                            end_time=self.end_time, instrumentation_scope=self.instrumentation_scope)


class StepBatcher:
    """Ended ``StepRecord``s, handed to ``exporter`` in batches of up to ``max_export_batch_size`` by a
    daemon thread that wakes every ``schedule_delay_millis`` or when a batch is full (the
    ``OTEL_BSP_*`` settings, as the SDK's batch processor reads them); at most ``max_queue_size``
    wait (the oldest are dropped beyond)."""

    def __init__(self, exporter: SpanExporter, resource: Resource, scope: InstrumentationScope,
                 schedule_delay_millis: int, max_export_batch_size: int, max_queue_size: int,
                 export_timeout_millis: int = 30000) -> None:
        self.resource, self.scope = resource, scope
        self._exporter = exporter
        self._delay = schedule_delay_millis / 1000
        self._batch = max_export_batch_size
        self._queue: collections.deque[StepRecord] = collections.deque(maxlen=max_queue_size)
        self._almost_full = min(max_export_batch_size, max_queue_size) - 1  # a record more fills a batch or the queue
        self._wake = threading.Event()
        self._export_lock = threading.Lock()
        self._stopped = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="step-span-export", daemon=True)
        self._thread.start()

    def add(self, record: StepRecord) -> None:
        queue = self._queue
        if len(queue) < self._almost_full:  # the usual case: one check
            queue.append(record)
            return
        if len(queue) == queue.maxlen:  # the oldest is dropped
            self.dropped += 1
        queue.append(record)
        if len(queue) >= self._batch and not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._delay)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Export every record ended so far, in the calling thread."""
        with self._export_lock:
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                try:
                    self._exporter.export(batch)  # type: ignore[arg-type]
                except Exception:  # an exporter's failure must not end the thread
                    logger.exception("exporting %d step spans failed", len(batch))

    def shutdown(self) -> None:
        """Stop the thread, export what is left, shut the exporter down."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.flush()
        self._exporter.shutdown()
