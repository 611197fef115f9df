"""The standard ``OTEL_*`` variables: the parts the serving process reads itself, from a mapping
given (the process environment by default) — whether tracing is on and the sampler — and the
environment of the export process, where the SDK reads the rest (the OTLP exporter's endpoint,
headers and certificates, the batch processor, the resource)."""

from __future__ import annotations

import os
from typing import Mapping

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import sampling

# The export process's batch processor, unless set: it exports every 50 ms (it has a core of its own,
# so exporting often costs the engine nothing and little waits at a flush), and its queue holds 8192
# spans, so a slow collector does not make it drop spans at once.
BATCH_DEFAULTS = {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_BSP_MAX_QUEUE_SIZE": "8192"}


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


def tracing_requested(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def export_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The export process's environment: this process's (how to import this package), its
    ``OTEL_*`` replaced by those of ``env``, with ``BATCH_DEFAULTS`` where unset."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return out | BATCH_DEFAULTS | {k: v for k, v in env.items() if k.startswith("OTEL_")}


def process_resource(component: str, dp_rank: int | None) -> Resource:
    """The SDK's resource from this process's environment (``OTEL_SERVICE_NAME``, else
    modeserve-<component>; ``OTEL_RESOURCE_ATTRIBUTES``, which cannot override the component and
    the DP rank)."""
    attributes: dict[str, str | int] = {"modeserve.component": component}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = f"modeserve-{component}"
    if dp_rank is not None:
        attributes["modeserve.dp_rank"] = dp_rank
    return Resource.create(attributes)
