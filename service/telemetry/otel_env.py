"""The standard ``OTEL_*`` variables, read from a mapping given (the process environment by default,
nothing else): whether tracing is on, the sampler, the batch processor's settings, the resource and
the OTLP/gRPC exporter."""

from __future__ import annotations

from typing import Any, Mapping

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import sampling


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
    """``OTEL_BSP_*`` for the export process: by default it exports every 50 ms (or 512 spans), so
    that little waits at a flush (it has a core of its own: exporting often costs the engine
    nothing); the queue holds 8192 spans, so a slow collector does not make it drop spans at once."""
    return {"schedule_delay_millis": int(env.get("OTEL_BSP_SCHEDULE_DELAY", "50")),
            "max_export_batch_size": int(env.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512")),
            "max_queue_size": int(env.get("OTEL_BSP_MAX_QUEUE_SIZE", "8192")),
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
