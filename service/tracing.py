"""OpenTelemetry tracing of a router or an engine, configured by the standard ``OTEL_*`` variables.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set and
``OTEL_SDK_DISABLED`` is not true; off means no provider, no spans, no context work (``enabled`` is
False and callers skip everything). On: spans go over OTLP/gRPC in batches; the sampler comes from
``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``, the resource from ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` plus the DP rank and, in Kubernetes, the pod name (``POD_NAME``).

Each process owns its provider (nothing is installed globally). Trace context travels as W3C
``traceparent``/``tracestate``: in gRPC metadata from clients to the router, and in
``ForwardBatch.trace_context`` from the router's step to the engine's forward.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

_PROPAGATOR = TraceContextTextMapPropagator()


def tracing_requested(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


class Tracing:
    """A process's tracer (or nothing, when tracing is off)."""

    def __init__(self, component: str, dp_rank: int | None = None, env: Mapping[str, str] | None = None,
                 exporter: SpanExporter | None = None) -> None:
        """``exporter``: where spans go instead of OTLP (tests: an in-memory exporter; turns tracing on)."""
        env = os.environ if env is None else env
        self.enabled = exporter is not None or tracing_requested(env)
        self._provider: object = None
        self.tracer: Tracer = trace.NoOpTracer()
        if not self.enabled:
            return
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        attributes: dict[str, str | int] = {"service.name": env.get("OTEL_SERVICE_NAME", f"modeserve-{component}"),
                                            "modeserve.component": component}
        if dp_rank is not None:
            attributes["modeserve.dp_rank"] = dp_rank
        if env.get("POD_NAME"):
            attributes["k8s.pod.name"] = env["POD_NAME"]
        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME from the environment
        provider = TracerProvider(resource=Resource.create(attributes))
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self._provider = provider
        self.tracer = provider.get_tracer("modeserve")

    def start_span(self, name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   links: Sequence[Link] = ()) -> Span:
        return self.tracer.start_span(name, context=parent, kind=kind, links=list(links))

    def shutdown(self) -> None:
        """Flush what is buffered (called when the process stops serving)."""
        if self._provider is not None:
            self._provider.shutdown()  # type: ignore[attr-defined]
            self._provider = None


def extract(carrier: Mapping[str, str]) -> Context:
    """The parent context carried by W3C headers (gRPC metadata keys are lower case)."""
    return _PROPAGATOR.extract(dict(carrier))


def inject(span: Span) -> dict[str, str]:
    """W3C headers that make ``span`` the parent on the other side."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def start_forward_span(tracing: Tracing, trace_context: Mapping[str, str], mode: str, batch_size: int,
                       num_tokens: int, graph_bucket: int | None, dp_rank: int, step: int) -> Span:
    """The engine's ``modeserve.forward`` span of one step, a child of the router's step span."""
    span = tracing.start_span("modeserve.forward", extract(trace_context), SpanKind.SERVER)
    span.set_attributes({
        "modeserve.forward_mode": mode, "modeserve.batch_size": batch_size, "modeserve.num_tokens": num_tokens,
        "modeserve.cuda_graph": graph_bucket is not None,
        "modeserve.padded_batch_size": graph_bucket if graph_bucket is not None else batch_size,
        "modeserve.dp_rank": dp_rank, "modeserve.step": step})
    return span
