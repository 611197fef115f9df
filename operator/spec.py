"""An EngineSet's spec as typed values, validated (the CRD schema checks shapes; this checks meaning).

``parse_spec`` raises ``InvalidSpec`` with every problem in one message: the operator turns it into a
Degraded condition and does not retry until the spec changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..engine.config import RunnerConfig, SchedulerConfig

# engine arguments an EngineSet may set: the engine CLI's flags (config fields), minus what the
# operator owns itself (the model path; the ranks of a pod: spec.tensorParallelSize)
_OWNED = {"model", "tensor_parallel_size"}
ENGINE_ARGS = sorted(({f for f in RunnerConfig.__dataclass_fields__} | {f for f in SchedulerConfig.__dataclass_fields__})
                     - _OWNED)
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$")
DISPATCH = ("prefix", "least-loaded", "round-robin")


class InvalidSpec(ValueError):
    """The EngineSet's spec cannot be deployed; the message says why (all problems at once)."""


GPU = "nvidia.com/gpu"


def _tensor_parallel_problems(tp: int, model: Mapping[str, Any], engine: Mapping[str, str],
                              requests: Mapping[str, str], limits: Mapping[str, str]) -> list[str]:
    """What is wrong with the ranks of a pod: a size below 1, one that does not divide the model's heads
    (where spec.model.attentionHeads gives them), GPUs that are not one a rank."""
    if tp < 1:
        return [f"spec.tensorParallelSize must be >= 1, got {tp}"]
    problems = []
    heads = model.get("attentionHeads")
    if heads is not None and (not isinstance(heads, int) or heads < 1 or heads % tp):
        problems.append(f"spec.tensorParallelSize {tp} must divide spec.model.attentionHeads ({heads!r})")
    for where, values in (("limits", limits), ("requests", requests)):
        if GPU in values and values[GPU] != str(tp):
            problems.append(f"spec.resources.{where}.{GPU} {values[GPU]!r} must equal spec.tensorParallelSize "
                            f"{tp} (a GPU a rank)")
    if tp > 1 and engine.get("device") != "cuda" and (GPU in limits or GPU in requests):
        problems.append(f"spec.resources ask for {GPU} but spec.engine.device is not cuda: the ranks would run on CPU")
    return problems


@dataclass(frozen=True)
class EngineSetSpec:
    model_path: str
    image: str
    image_pull_policy: str = "IfNotPresent"
    replicas: int = 1
    tensor_parallel_size: int = 1
    pvc: str | None = None
    host_path: str | None = None
    engine: dict[str, str] = field(default_factory=dict)
    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)
    router_replicas: int = 1
    dispatch: str = "prefix"
    dp_lockstep: bool = False
    router_http_port: int = 8000
    network_policy: bool = True
    metrics_namespace_selector: dict[str, str] = field(
        default_factory=lambda: {"kubernetes.io/metadata.name": "monitoring"})
    tracing_endpoint: str | None = None
    tracing_sampler: str | None = None
    tracing_sampler_arg: str | None = None
    drain_timeout_seconds: int = 300
    termination_grace_period_seconds: int = 120
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    tls_secret: str | None = None  # a Secret with tls.crt, tls.key and ca.crt: TLS everywhere, mutual to engines
    api_key_secret: str | None = None  # a Secret holding the routers' API key ...
    api_key_secret_key: str = "api-key"  # ... under this key
    max_queued_requests: int = 1024  # per router: requests waiting past it get RESOURCE_EXHAUSTED / 429
    max_streams_per_connection: int = 4096  # per client connection to a router (HTTP/2 MAX_CONCURRENT_STREAMS)

    @property
    def gpus(self) -> int:
        return int(self.limits.get(GPU, self.requests.get(GPU, "0")))


def parse_spec(spec: Mapping[str, Any], default_image: str) -> EngineSetSpec:
    problems: list[str] = []
    model = spec.get("model") or {}
    path = str(model.get("path") or "")
    if not path:
        problems.append("spec.model.path is required")
    if model.get("pvc") and model.get("hostPath"):
        problems.append("spec.model: give pvc or hostPath, not both")
    engine = {str(k): str(v) for k, v in (spec.get("engine") or {}).items()}
    unknown = sorted(set(engine) - set(ENGINE_ARGS))
    if unknown:
        problems.append(f"spec.engine: unknown engine argument(s) {unknown}; known: {ENGINE_ARGS}")
    if "device" in engine and engine["device"] not in ("cpu", "cuda"):
        problems.append(f"spec.engine.device must be cpu or cuda, got {engine['device']!r}")
    replicas = int(spec.get("replicas", 1))
    if replicas < 0:
        problems.append(f"spec.replicas must be >= 0, got {replicas}")
    if "tensor_parallel_size" in engine:
        problems.append("spec.engine.tensor_parallel_size: set spec.tensorParallelSize instead")
    tp = int(spec.get("tensorParallelSize", 1))
    resources = spec.get("resources") or {}
    requests = {str(k): str(v) for k, v in (resources.get("requests") or {}).items()}
    limits = {str(k): str(v) for k, v in (resources.get("limits") or {}).items()}
    for where, values in (("requests", requests), ("limits", limits)):
        for k, v in values.items():
            if not _QUANTITY.match(v):
                problems.append(f"spec.resources.{where}.{k}: {v!r} is not a quantity")
    problems += _tensor_parallel_problems(tp, model, engine, requests, limits)
    if tp >= 1 and engine.get("device") == "cuda" and GPU not in limits and GPU not in requests:
        limits[GPU] = str(tp)  # a GPU a rank
    router = spec.get("router") or {}
    dispatch = str(router.get("dispatch", "prefix"))
    if dispatch not in DISPATCH:
        problems.append(f"spec.router.dispatch must be one of {DISPATCH}, got {dispatch!r}")
    policy = spec.get("networkPolicy") or {}
    http_port = router.get("httpPort", 8000)
    if not isinstance(http_port, int) or not 1 <= http_port <= 65535:
        problems.append(f"spec.router.httpPort must be a port in [1, 65535], got {http_port!r}")
    tls = spec.get("tls") or {}
    if tls.get("enabled") and not tls.get("secretName"):
        problems.append("spec.tls.enabled needs spec.tls.secretName (a Secret with tls.crt, tls.key and ca.crt)")
    api_key = router.get("apiKey") or {}
    if api_key and not api_key.get("secretName"):
        problems.append("spec.router.apiKey needs secretName (the Secret holding the key)")
    router_limits = router.get("limits") or {}
    queued, streams = router_limits.get("maxQueuedRequests", 1024), router_limits.get("maxStreamsPerConnection", 4096)
    for key, value in (("maxQueuedRequests", queued), ("maxStreamsPerConnection", streams)):
        if not isinstance(value, int) or value < 1:
            problems.append(f"spec.router.limits.{key} must be an integer >= 1, got {value!r}")
    image = str(spec.get("image") or default_image)
    if not image:
        problems.append("spec.image is empty and the operator has no default image")
    if problems:
        raise InvalidSpec("; ".join(problems))
    tracing = spec.get("tracing") or {}
    tracing_on = bool(tracing.get("enabled"))
    return EngineSetSpec(
        model_path=path, image=image, image_pull_policy=str(spec.get("imagePullPolicy", "IfNotPresent")),
        replicas=replicas, tensor_parallel_size=tp, pvc=model.get("pvc"), host_path=model.get("hostPath"),
        engine=engine, requests=requests, limits=limits, router_replicas=int(router.get("replicas", 1)),
        dispatch=dispatch, dp_lockstep=bool(router.get("dpLockstep", False)),
        router_http_port=http_port,
        network_policy=bool(policy.get("enabled", True)),
        metrics_namespace_selector={str(k): str(v) for k, v in (policy.get("metricsNamespaceSelector") or
                                                                {"kubernetes.io/metadata.name": "monitoring"}).items()},
        tracing_endpoint=tracing.get("endpoint") if tracing_on else None,
        tracing_sampler=tracing.get("sampler") if tracing_on else None,
        tracing_sampler_arg=tracing.get("samplerArg") if tracing_on else None,
        drain_timeout_seconds=int(spec.get("drainTimeoutSeconds", 300)),
        termination_grace_period_seconds=int(spec.get("terminationGracePeriodSeconds", 120)),
        node_selector={str(k): str(v) for k, v in (spec.get("nodeSelector") or {}).items()},
        tolerations=list(spec.get("tolerations") or []),
        tls_secret=str(tls["secretName"]) if tls.get("enabled") else None,
        api_key_secret=str(api_key["secretName"]) if api_key else None,
        api_key_secret_key=str(api_key.get("key") or "api-key"),
        max_queued_requests=queued, max_streams_per_connection=streams,
    )
