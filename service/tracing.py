"""OpenTelemetry tracing of a router or an engine, configured by the standard ``OTEL_*`` variables.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set and
``OTEL_SDK_DISABLED`` is not true; off means no provider, no spans, no context work (``enabled`` is
False and callers skip everything). On: spans go over OTLP/gRPC in batches; the sampler comes from
``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``, the resource from ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` plus the DP rank and, in Kubernetes, the pod name (``POD_NAME``). The
variables are read from the mapping given (the process environment by default), nothing else.

Each process owns its provider (nothing is installed globally). Trace context travels as W3C
``traceparent``/``tracestate``: in gRPC metadata from clients to the router, and in
``ForwardBatch.trace_context`` from the router's step to the engine's forward.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.sampling import Sampler

_PROPAGATOR = TraceContextTextMapPropagator()


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
        for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
            key, _, value = item.partition("=")
            if key.strip() and value:
                attributes.setdefault(key.strip(), value.strip())
        provider = TracerProvider(resource=Resource(attributes), sampler=sampler_from_env(env))
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
            insecure = endpoint.startswith("http://") or env.get("OTEL_EXPORTER_OTLP_INSECURE", "").lower() == "true"
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
        self._provider = provider
        self.tracer = provider.get_tracer("modeserve")

    def start_span(self, name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   links: Sequence[Link] = (), attributes: Mapping[str, Any] | None = None) -> Span:
        return self.tracer.start_span(name, context=parent, kind=kind, links=list(links), attributes=attributes)

    def shutdown(self) -> None:
        """Flush what is buffered (called when the process stops serving)."""
        if self._provider is not None:
            self._provider.shutdown()  # type: ignore[attr-defined]
            self._provider = None


def extract(carrier: Mapping[str, str]) -> Context:
    """The parent context carried by W3C headers (gRPC metadata keys are lower case)."""
    return _PROPAGATOR.extract(dict(carrier))


def inject(span: Span) -> dict[str, str]:
    """W3C ``traceparent`` (version 00) that makes ``span`` the parent on the other side; written
    directly: this runs once per step."""
    ctx = span.get_span_context()
    return {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"}


def start_forward_span(tracing: Tracing, trace_context: Mapping[str, str], mode: str, batch_size: int,
                       num_tokens: int, graph_bucket: int | None, dp_rank: int, step: int) -> Span:
    """The engine's ``modeserve.forward`` span of one step, a child of the router's step span."""
    return tracing.start_span("modeserve.forward", extract(trace_context), SpanKind.SERVER, attributes={
        "modeserve.forward_mode": mode, "modeserve.batch_size": batch_size, "modeserve.num_tokens": num_tokens,
        "modeserve.dp_rank": dp_rank, "modeserve.step": step, **forward_attributes(graph_bucket, batch_size)})


def forward_attributes(graph_bucket: int | None, batch_size: int) -> dict[str, Any]:
    """What only the engine knows about a step: whether it replayed a CUDA graph, padded to what."""
    return {"modeserve.cuda_graph": graph_bucket is not None,
            "modeserve.padded_batch_size": graph_bucket if graph_bucket is not None else batch_size}
