"""OpenTelemetry tracing of a router or an engine, configured by the standard ``OTEL_*`` variables.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set and
``OTEL_SDK_DISABLED`` is not true; off means no provider, no spans, no context work (``enabled`` is
False and callers skip everything). On: spans go over OTLP/gRPC in batches (``OTEL_BSP_*``, encoded by
``otlp_encoding``); the sampler comes from ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``, the
resource from ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` plus the DP rank and, in
Kubernetes, the pod name (``POD_NAME``). The variables are read from the mapping given (the process
environment by default), nothing else.

Each process owns its provider (nothing is installed globally). Trace context travels as W3C
``traceparent``/``tracestate``: in gRPC metadata from clients to the router, and in
``ForwardBatch.trace_context`` from the router's step to the engine's forward. Request spans are the
SDK's; the spans made every step are ``StepRecord``s on the OTLP path (``step_record``: fields only,
written as wire bytes by the export thread) and ``StepSpan``s with a test's exporter (``step_span``).
"""

from __future__ import annotations

import functools
import os
import random
import re
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (INVALID_SPAN_CONTEXT, Link, NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags,
                                 Tracer)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.sampling import Sampler

    from .step_record import StepBatcher, StepRecord
    from .step_span import StepSpan

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
RANDOM_TRACE_ID = int(getattr(TraceFlags, "RANDOM_TRACE_ID", 0))  # W3C level 2 flag, inherited by children
SAMPLED_FLAGS = {0: TraceFlags(TraceFlags.SAMPLED), RANDOM_TRACE_ID: TraceFlags(TraceFlags.SAMPLED | RANDOM_TRACE_ID)}
_getrandbits = random.getrandbits  # what RandomIdGenerator calls (the random module's shared generator)


def sampler_from_env(env: Mapping[str, str]) -> Sampler:
    """``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default: parent-based, always on)."""
    from opentelemetry.sdk.trace import sampling

    name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").lower()
    ratio = float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0") or 1.0)
    table: dict[str, Sampler] = {
        "always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
        "traceidratio": sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": sampling.ParentBased(sampling.TraceIdRatioBased(ratio)),
    }
    if name not in table:
        raise ValueError(f"OTEL_TRACES_SAMPLER={name!r} is not one of {sorted(table)}")
    return table[name]


def batch_settings_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """``OTEL_BSP_*``: by default the exporter thread wakes every 2048 spans (or 5 s), so that it
    holds the GIL rarely (the wake-up and the export call cost the same for any batch size); the
    queue holds four batches, so a slow collector does not make the engine drop spans at once."""
    batch = int(env.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2048"))
    return {"schedule_delay_millis": int(env.get("OTEL_BSP_SCHEDULE_DELAY", "5000")),
            "max_export_batch_size": batch,
            "max_queue_size": int(env.get("OTEL_BSP_MAX_QUEUE_SIZE", str(4 * batch))),
            "export_timeout_millis": int(env.get("OTEL_BSP_EXPORT_TIMEOUT", "30000"))}


def tracing_requested(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


class Tracing:
    """A process's tracer (or nothing, when tracing is off)."""

    def __init__(self, component: str, dp_rank: int | None = None, env: Mapping[str, str] | None = None,
                 exporter: SpanExporter | None = None, batched: bool = False) -> None:
        """``exporter``: where spans go instead of OTLP (turns tracing on): each span as it ends (tests:
        an in-memory exporter), or with ``batched`` in batches as OTLP's go (step spans as records)."""
        env = os.environ if env is None else env
        self.enabled = exporter is not None or tracing_requested(env)
        self.flush_seconds = 0.0
        self._steps: StepBatcher | None = None  # the OTLP path's step spans (records, not SDK objects)
        self._provider: object = None
        self.tracer: Tracer = trace.NoOpTracer()
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from .step_span import StepSpan

        attributes: dict[str, str | int] = {"service.name": env.get("OTEL_SERVICE_NAME", f"modeserve-{component}"),
                                            "modeserve.component": component}
        if dp_rank is not None:
            attributes["modeserve.dp_rank"] = dp_rank
        if env.get("POD_NAME"):
            attributes["k8s.pod.name"] = env["POD_NAME"]
        for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
            key, _, value = item.partition("=")
            if key.strip() and value:
                attributes.setdefault(key.strip(), value.strip())
        provider = TracerProvider(resource=Resource(attributes), sampler=sampler_from_env(env))
        scope = InstrumentationScope("modeserve")
        processor: SpanProcessor
        if exporter is not None and not batched:
            processor = SimpleSpanProcessor(exporter)
        else:
            from .otlp_encoding import FastOTLPSpanExporter
            from .step_record import StepBatcher, StepRecord

            endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
            insecure = endpoint.startswith("http://") or env.get("OTEL_EXPORTER_OTLP_INSECURE", "").lower() == "true"
            settings = batch_settings_from_env(env)
            otlp = lambda: FastOTLPSpanExporter(endpoint=endpoint, insecure=insecure)  # noqa: E731
            processor = BatchSpanProcessor(exporter or otlp(), **settings)
            self._steps = StepBatcher(exporter or otlp(), provider.resource, scope, **settings)
            self._new_record = StepRecord
        provider.add_span_processor(processor)
        self._provider = provider
        self.tracer = provider.get_tracer("modeserve")
        # what step spans take from the provider
        self._sampler, self._ids = provider.sampler, provider.id_generator
        self._random_ids = type(provider.id_generator) is RandomIdGenerator  # its ids drawn here, without a call
        self._new_step_span = functools.partial(StepSpan, processor, provider.resource, scope)
        # the last parent span, its context, whether sampled, the flags, the sampling result
        self._last_sampling: tuple[Span | None, SpanContext, bool, Any, Any] = (None, INVALID_SPAN_CONTEXT, False, None,
                                                                               None)

    def start_span(self, name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   links: Sequence[Link] = (), attributes: Mapping[str, Any] | None = None) -> Span:
        return self.tracer.start_span(name, context=parent, kind=kind, links=list(links), attributes=attributes)

    def start_step_span(self, name: str, parent: Span, kind: SpanKind, links: Sequence[SpanContext],
                        attributes: dict[str, Any]) -> StepSpan | StepRecord | None:
        """The span of one step, a child of ``parent`` (whose context is valid), linked to ``links``;
        None unless the provider's sampler samples it. The samplers ``OTEL_TRACES_SAMPLER`` names
        decide by the parent and the trace id alone (and add no attributes), so consecutive steps in
        one request's trace ask once."""
        # one tuple (loops of several ranks may share this); a span's context never changes
        last_parent, parent_ctx, sampled, flags, result = self._last_sampling
        if parent is not last_parent:
            last_ctx, parent_ctx = parent_ctx, parent.get_span_context()
            if parent_ctx is not last_ctx and parent_ctx != last_ctx:
                result = self._sampler.should_sample(trace.set_span_in_context(parent), parent_ctx.trace_id, name,
                                                     kind, attributes, [Link(ctx) for ctx in links])
                sampled, flags = result.decision.is_sampled(), SAMPLED_FLAGS[parent_ctx.trace_flags & RANDOM_TRACE_ID]
            self._last_sampling = (parent, parent_ctx, sampled, flags, result)
        if not sampled:
            return None
        span_id = _getrandbits(64) if self._random_ids else 0  # as RandomIdGenerator draws them
        if not span_id:  # another generator's turn (or zero, not a valid id)
            span_id = self._ids.generate_span_id()
        if self._steps is not None:
            return self._new_record(self._steps, name, span_id, parent_ctx, kind, tuple(links) if links else (),
                                    attributes)
        context = SpanContext(parent_ctx.trace_id, span_id, False, flags, result.trace_state)
        return self._new_step_span(name, context, parent_ctx, kind, [Link(ctx) for ctx in links] if links else (),
                                   attributes)

    def flush(self) -> None:
        """Export every span ended so far, in the calling thread (benchmarks time it; the seconds
        spent here add up in ``flush_seconds``)."""
        if self._provider is not None:
            start = time.perf_counter()
            self._provider.force_flush()  # type: ignore[attr-defined]
            if self._steps is not None:
                self._steps.flush()
            self.flush_seconds += time.perf_counter() - start

    def shutdown(self) -> None:
        """Flush what is buffered (called when the process stops serving)."""
        if self._provider is not None:
            if self._steps is not None:
                self._steps.shutdown()
            self._provider.shutdown()  # type: ignore[attr-defined]
            self._provider = None


def extract(carrier: Mapping[str, str]) -> Context:
    """The parent context carried by W3C headers (gRPC metadata keys are lower case)."""
    return _PROPAGATOR.extract(dict(carrier))


def inject(span: Span | StepSpan | StepRecord) -> dict[str, str]:
    """W3C ``traceparent`` (version 00) that makes ``span`` the parent on the other side; written
    directly: this runs once per step."""
    ctx = span.get_span_context()
    return {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"}


def remote_parent(trace_context: Mapping[str, str]) -> Span | None:
    """The span ``trace_context`` names as the parent, None without a valid one; ``inject``'s form
    is read directly (once per step at the engine), any other through the W3C propagator."""
    match = _TRACEPARENT.fullmatch(trace_context.get("traceparent", ""))
    if match is not None and "tracestate" not in trace_context:
        trace_id, span_id, flags = (int(group, 16) for group in match.groups())
        ctx = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
    else:
        ctx = trace.get_current_span(extract(trace_context)).get_span_context()
    return NonRecordingSpan(ctx) if ctx.is_valid else None


def start_forward_span(tracing: Tracing, trace_context: Mapping[str, str], mode: str, batch_size: int,
                       num_tokens: int, graph_bucket: int | None, dp_rank: int) -> Span | StepSpan | StepRecord | None:
    """The engine's ``modeserve.forward`` span of one step, a child of the router's step span (a
    root span, made by the SDK, when the batch carries no trace context); None when not sampled.
    Step spans carry no step number: an attribute unique to each span would keep the exporter from
    encoding the steps of a decode as one shape (``otlp_encoding``)."""
    attributes = {"modeserve.forward_mode": mode, "modeserve.batch_size": batch_size, "modeserve.num_tokens": num_tokens,
                  "modeserve.dp_rank": dp_rank, **forward_attributes(graph_bucket, batch_size)}
    parent = remote_parent(trace_context)
    if parent is None:
        return tracing.start_span("modeserve.forward", None, SpanKind.SERVER, attributes=attributes)
    return tracing.start_step_span("modeserve.forward", parent, SpanKind.SERVER, (), attributes)


def forward_attributes(graph_bucket: int | None, batch_size: int) -> dict[str, Any]:
    """What only the engine knows about a step: whether it replayed a CUDA graph, padded to what."""
    return {"modeserve.cuda_graph": graph_bucket is not None,
            "modeserve.padded_batch_size": graph_bucket if graph_bucket is not None else batch_size}
