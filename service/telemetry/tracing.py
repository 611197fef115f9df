"""OpenTelemetry tracing of a router or an engine, configured by the standard ``OTEL_*`` variables.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set and
``OTEL_SDK_DISABLED`` is not true; off means no provider, no spans, no context work (``enabled`` is
False and callers skip everything). On: the SDK's OTLP/gRPC exporter under its batch span processor
(``OTEL_BSP_*``); the sampler comes from ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``, the
resource from ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` plus the DP rank and, in
Kubernetes, the pod name (``POD_NAME``). The variables are read from the mapping given (the process
environment by default), nothing else.

Each instance owns its provider (nothing is installed globally). Trace context travels as W3C
``traceparent``/``tracestate``: in gRPC metadata from clients to the router, and in
``ForwardBatch.trace_context`` from the router's step to the engine's forward. Every span is the
SDK's, made through its public API; the per-step spans are ``step_tracing``'s.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Link, Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def sampler_from_env(env: Mapping[str, str]) -> sampling.Sampler:
    """``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default: parent-based, always on)."""
    name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").lower()
    ratio = float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0") or 1.0)
    table: dict[str, sampling.Sampler] = {
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
    holds the GIL rarely; the queue holds four batches, so a slow collector does not make the
    engine drop spans at once."""
    batch = int(env.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2048"))
    return {"schedule_delay_millis": int(env.get("OTEL_BSP_SCHEDULE_DELAY", "5000")),
            "max_export_batch_size": batch,
            "max_queue_size": int(env.get("OTEL_BSP_MAX_QUEUE_SIZE", str(4 * batch))),
            "export_timeout_millis": int(env.get("OTEL_BSP_EXPORT_TIMEOUT", "30000"))}


def tracing_requested(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def resource_from_env(component: str, dp_rank: int | None, env: Mapping[str, str]) -> Resource:
    """The process's resource: service name, component, DP rank, pod, then ``OTEL_RESOURCE_ATTRIBUTES``
    (which cannot override the ones set here)."""
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
    return Resource(attributes)


def otlp_exporter_from_env(env: Mapping[str, str]) -> OTLPSpanExporter:
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    insecure = endpoint.startswith("http://") or env.get("OTEL_EXPORTER_OTLP_INSECURE", "").lower() == "true"
    return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)


class Tracing:
    """A process's tracer (or nothing, when tracing is off)."""

    def __init__(self, component: str, dp_rank: int | None = None, env: Mapping[str, str] | None = None,
                 exporter: SpanExporter | None = None, batched: bool = False) -> None:
        """``exporter``: where spans go instead of OTLP (turns tracing on): each span as it ends (tests:
        an in-memory exporter), or with ``batched`` in batches as OTLP's go."""
        env = os.environ if env is None else env
        self.enabled = exporter is not None or tracing_requested(env)
        self.flush_seconds = 0.0
        self._provider: TracerProvider | None = None
        self.tracer: Tracer = trace.NoOpTracer()
        if not self.enabled:
            return
        processor: SpanProcessor
        if exporter is not None and not batched:
            processor = SimpleSpanProcessor(exporter)
        else:
            processor = BatchSpanProcessor(exporter or otlp_exporter_from_env(env), **batch_settings_from_env(env))
        self._provider = TracerProvider(resource=resource_from_env(component, dp_rank, env),
                                        sampler=sampler_from_env(env))
        self._provider.add_span_processor(processor)
        self.tracer = self._provider.get_tracer("modeserve")

    def start_span(self, name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   links: Sequence[Link] = (), attributes: Mapping[str, Any] | None = None,
                   start_time: int | None = None) -> Span:
        """A span (non-recording when tracing is off or the sampler drops it); ``parent``: the
        context it is a child of (None: a root span); ``start_time`` in ns since the epoch (None: now)."""
        return self.tracer.start_span(name, context=parent, kind=kind, links=list(links), attributes=attributes,
                                      start_time=start_time)

    def flush(self) -> None:
        """Export every span ended so far (benchmarks time it; the seconds spent here add up in
        ``flush_seconds``)."""
        if self._provider is not None:
            start = time.perf_counter()
            self._provider.force_flush()
            self.flush_seconds += time.perf_counter() - start

    def shutdown(self) -> None:
        """Flush what is buffered and stop the exporter (called when the process stops serving)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None


def extract(carrier: Mapping[str, str]) -> Context:
    """The parent context carried by W3C headers (gRPC metadata keys are lower case); an empty
    context (a root span follows) when there is none or it is invalid."""
    return _PROPAGATOR.extract(dict(carrier))


def inject(span: Span) -> dict[str, str]:
    """The W3C headers that make ``span`` the parent on the other side (empty for an invalid span)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def forward_attributes(graph_bucket: int | None, batch_size: int) -> dict[str, Any]:
    """What only the engine knows about a step: whether it replayed a CUDA graph, padded to what."""
    return {"modeserve.cuda_graph": graph_bucket is not None,
            "modeserve.padded_batch_size": graph_bucket if graph_bucket is not None else batch_size}
