"""OpenTelemetry tracing of a router or an engine, configured by the standard ``OTEL_*`` variables
(``otel_env``).

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set and
``OTEL_SDK_DISABLED`` is not true; off means no spans, no context work (``enabled`` is False and
callers skip everything). On, a span is a ``SpanRecord`` while it runs: ``start`` draws its ids and
asks the sampler (from ``OTEL_TRACES_SAMPLER``), as the SDK's tracer would; ``end`` hands a sampled
one to the sink that makes it an SDK span and exports it: the export process (``export_process``,
the SDK's OTLP/gRPC exporter under its batch processor, ``OTEL_BSP_*``), or, given an exporter (tests,
benchmarks), the SDK in this process. The resource is the SDK's (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``: the operator puts the pod's name there) plus the component and the DP rank.

Trace context travels as W3C ``traceparent``/``tracestate``: in gRPC metadata from clients to the
router, and in ``ForwardBatch.trace_context`` from the router's step to the engine's forward. The
per-step spans are ``step_tracing``'s.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping, Protocol, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import INVALID_SPAN_CONTEXT, NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .export_process import ExportProcess
from .otel_env import process_resource, sampler_from_env, tracing_requested
from .span_record import SdkSink, SpanRecord

_PROPAGATOR = TraceContextTextMapPropagator()


class SpanSink(Protocol):
    def emit(self, record: SpanRecord) -> None: ...

    def flush(self) -> None: ...

    def shutdown(self) -> None: ...


class Tracing:
    """A process's spans (or nothing, when tracing is off)."""

    def __init__(self, component: str, dp_rank: int | None = None, env: Mapping[str, str] | None = None,
                 exporter: SpanExporter | None = None, batched: bool = False) -> None:
        """``exporter``: where spans go instead of OTLP (turns tracing on), made in this process: each
        span as it ends (tests: an in-memory exporter), or with ``batched`` in batches as OTLP's go."""
        env = os.environ if env is None else env
        self.enabled = exporter is not None or tracing_requested(env)
        self.flush_seconds = 0.0
        self._sink: SpanSink | None = None
        if not self.enabled:
            return
        self._sampler = sampler_from_env(env)
        self._ids = RandomIdGenerator()
        if exporter is None:
            self._sink = ExportProcess(component, dp_rank, env)
            return
        processor: SpanProcessor = BatchSpanProcessor(exporter) if batched else SimpleSpanProcessor(exporter)
        self._sink = SdkSink(process_resource(component, dp_rank), processor)

    def start(self, name: str, parent: SpanContext | None = None, kind: SpanKind = SpanKind.INTERNAL,
              attributes: dict[str, Any] | None = None, links: Sequence[SpanContext] = (),
              start_time: int | None = None) -> SpanRecord:
        """A span's record, sampled or not (never sampled when tracing is off); ``parent``: the
        context it is a child of (None or invalid: a root span); ``start_time`` in ns since the epoch
        (None: now)."""
        attributes = attributes if attributes is not None else {}
        start_time = start_time or time.time_ns()
        if not self.enabled:
            return SpanRecord(name, kind, INVALID_SPAN_CONTEXT, None, start_time, attributes)
        if parent is not None and not parent.is_valid:
            parent = None
        trace_id = parent.trace_id if parent is not None else self._ids.generate_trace_id()
        parent_ctx = trace.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else Context()
        result = self._sampler.should_sample(parent_ctx, trace_id, name, kind, attributes)
        flags = TraceFlags.SAMPLED if result.decision.is_sampled() else TraceFlags.DEFAULT
        if parent is None or parent.trace_flags.random_trace_id:  # as the SDK's tracer sets it
            flags |= TraceFlags.RANDOM_TRACE_ID
        context = SpanContext(trace_id, self._ids.generate_span_id(), False, TraceFlags(flags), result.trace_state)
        if result.attributes:
            attributes.update(result.attributes)
        return SpanRecord(name, kind, context, parent, start_time, attributes, list(links))

    def start_child(self, name: str, parent: SpanRecord, kind: SpanKind, attributes: dict[str, Any],
                    links: list[SpanContext]) -> SpanRecord:
        """A span of this process under ``parent``, a sampled span of this process (the step under its
        head request), started now: sampled without asking the sampler, since every sampler
        ``sampler_from_env`` builds keeps it (the parent-based ones by its parent, ``traceidratio``
        by the trace id its parent was kept for). A step's hot path: no more than a span id drawn."""
        ctx = parent.context
        context = SpanContext(ctx.trace_id, self._ids.generate_span_id(), False, ctx.trace_flags, ctx.trace_state)
        return SpanRecord(name, kind, context, ctx, time.time_ns(), attributes, links)

    def end(self, record: SpanRecord, end_time: int | None = None) -> None:
        """End a span (again: nothing); a sampled one is made and exported."""
        if not record.recording:
            return
        record.end_time = end_time or time.time_ns()
        if self._sink is not None:
            self._sink.emit(record)

    def flush(self) -> None:
        """Export every span ended so far (benchmarks time it; the seconds spent here add up in
        ``flush_seconds``)."""
        if self._sink is not None:
            start = time.perf_counter()
            self._sink.flush()
            self.flush_seconds += time.perf_counter() - start

    def shutdown(self) -> None:
        """Export what is pending and stop the exporter (called when the process stops serving)."""
        if self._sink is not None:
            self._sink.shutdown()
            self._sink = None


def extract(carrier: Mapping[str, str]) -> SpanContext | None:
    """The parent context carried by W3C headers (gRPC metadata keys are lower case); None (a root
    span follows) when there is none or it is invalid."""
    ctx = trace.get_current_span(_PROPAGATOR.extract(dict(carrier))).get_span_context()
    return ctx if ctx.is_valid else None


def inject(context: SpanContext) -> dict[str, str]:
    """The W3C headers that make the span of ``context`` the parent on the other side (empty for an
    invalid context)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(NonRecordingSpan(context)))
    return carrier
