"""The Kubernetes objects one EngineSet owns, as plain dicts built from its spec (pure functions).

Per EngineSet ``NAME``: a StatefulSet ``NAME-engine`` (one pod per DP rank, rank = pod index), its
headless Service ``NAME-engine`` (stable pod DNS for the router), a ConfigMap ``NAME-engine`` (DP_SIZE), a router Deployment ``NAME-router``
and the client-facing Service ``NAME`` (Generate on 50051, the OpenAI HTTP API on 8000, the operator's
Admin API on 50053, metrics on 9090). All carry an
owner reference to the EngineSet, so deleting it deletes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import secure_serving as sec
from .spec import EngineSetSpec

ENGINE_PORT = 50061
ROUTER_PORT = 50051
ROUTER_ADMIN_PORT = 50053  # the routers' Admin API (SetRanks), apart from Generate: mutual TLS under spec.tls
ROUTER_HTTP_PORT = 8000  # the Service's port of the OpenAI-compatible HTTP API (the pods': spec.router.httpPort)
METRICS_PORT = 9090
GROUP = "modeserve.io"
VERSION = "v1alpha1"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
MODEL_MOUNT = "/models"

Obj = dict[str, Any]
EngineSet = Mapping[str, Any]  # the EngineSet object as the API returns it (read only)


def labels(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "modeserve", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component, "app.kubernetes.io/part-of": "modeserve",
            "modeserve.io/engineset": name}


def selector(name: str, component: str) -> dict[str, str]:
    return {"modeserve.io/engineset": name, "app.kubernetes.io/component": component}


def engine_selector_string(name: str) -> str:
    """The engine pods' label selector as the scale subresource wants it (status.selector)."""
    return ",".join(f"{k}={v}" for k, v in selector(name, "engine").items())


def owner_reference(es: EngineSet) -> Obj:
    meta = es["metadata"]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "EngineSet", "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def rank_address(name: str, namespace: str, rank: int) -> str:
    """DNS name of rank ``rank``'s engine through the headless Service."""
    return f"{name}-engine-{rank}.{name}-engine.{namespace}.svc:{ENGINE_PORT}"


def _container_security() -> Obj:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "runAsUser": 10001, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def _pod_security() -> Obj:
    return {"runAsNonRoot": True, "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}}


def _tracing_env(spec: EngineSetSpec, service: str) -> list[Obj]:
    if spec.tracing_endpoint is None:
        return []
    env = [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": spec.tracing_endpoint},
           {"name": "OTEL_SERVICE_NAME", "value": service}]
    if spec.tracing_sampler:
        env.append({"name": "OTEL_TRACES_SAMPLER", "value": spec.tracing_sampler})
    if spec.tracing_sampler_arg:
        env.append({"name": "OTEL_TRACES_SAMPLER_ARG", "value": spec.tracing_sampler_arg})
    return env


def _model_volume(spec: EngineSetSpec) -> tuple[list[Obj], list[Obj]]:
    """(volumes, mounts) holding the model, read-only."""
    if spec.pvc:
        source: Obj = {"persistentVolumeClaim": {"claimName": spec.pvc, "readOnly": True}}
    elif spec.host_path:
        source = {"hostPath": {"path": spec.host_path, "type": "Directory"}}
    else:
        return [], []  # the model is inside the image
    return [{"name": "model", **source}], [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]


def model_path(spec: EngineSetSpec) -> str:
    """The model's path in the container: relative paths are under the mounted volume."""
    if (spec.pvc or spec.host_path) and not spec.model_path.startswith("/"):
        return f"{MODEL_MOUNT}/{spec.model_path}"
    return spec.model_path


def engine_args(spec: EngineSetSpec) -> list[str]:
    """The engine command line after ``modeserve``; $(DP_RANK) is expanded by the kubelet."""
    args = ["engine", "--model", model_path(spec), "--host", "0.0.0.0", "--port", str(ENGINE_PORT),
            "--dp-rank", "$(DP_RANK)", "--grace-period", str(max(spec.termination_grace_period_seconds - 10, 1)),
            "--metrics-port", str(METRICS_PORT), *sec.tls_args(spec, sec.ENGINE_HEALTH_PORT)]
    if spec.tensor_parallel_size > 1:  # the engine process is rank 0 and starts the others in the pod
        args += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    for key, value in sorted(spec.engine.items()):
        flag = "--" + key.replace("_", "-")
        if value.lower() in ("true", "false"):
            args.append(flag if value.lower() == "true" else "--no-" + key.replace("_", "-"))
        else:
            args += [flag, value]
    return args


def engine_statefulset(es: EngineSet, spec: EngineSetSpec, replicas: int) -> Obj:
    """The engines: ``replicas`` pods, rank i = pod i (pod-index label -> DP_RANK)."""
    name, ns = es["metadata"]["name"], es["metadata"]["namespace"]
    volumes, mounts = _model_volume(spec)
    secret_volumes, secret_mounts = sec.secret_volumes(spec, api_key=False)
    probe = sec.probe_port(spec, ENGINE_PORT, sec.ENGINE_HEALTH_PORT)
    resources: Obj = {}
    if spec.requests:
        resources["requests"] = dict(spec.requests)
    if spec.limits:
        resources["limits"] = dict(spec.limits)
    env = [
        {"name": "DP_RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}},
        # from a ConfigMap, not the template: a new size must not restart the ranks that stay
        {"name": "DP_SIZE", "valueFrom": {"configMapKeyRef": {"name": f"{name}-engine", "key": "DP_SIZE"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": "modeserve.dp_rank=$(DP_RANK),k8s.pod.name=$(POD_NAME)"},
        {"name": "HOME", "value": "/tmp"},
        *_tracing_env(spec, f"{name}-engine"),
    ]
    container: Obj = {
        "name": "engine",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": engine_args(spec),
        "env": env,
        "ports": [{"name": "grpc", "containerPort": ENGINE_PORT}, {"name": "metrics", "containerPort": METRICS_PORT}],
        # gRPC health: readiness per service (NOT_SERVING while draining), liveness on "" (the process)
        "startupProbe": {"grpc": {"port": probe, "service": ""}, "periodSeconds": 5, "failureThreshold": 360},
        "livenessProbe": {"grpc": {"port": probe, "service": ""}, "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {"grpc": {"port": probe, "service": "modeserve.v1.Engine"}, "periodSeconds": 5},
        # drain before SIGTERM: no new streams, running ones finish, inside the grace period
        "lifecycle": {"preStop": {"exec": {"command": [
            "modeserve", "drain", "--server", f"{'localhost' if spec.tls_secret else '127.0.0.1'}:{ENGINE_PORT}",
            "--timeout", str(max(spec.termination_grace_period_seconds - 15, 1)), *sec.drain_tls_args(spec)]}}},
        "resources": resources,
        "securityContext": _container_security(),
        "volumeMounts": [*mounts, *secret_mounts, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "shm", "mountPath": "/dev/shm"}],
    }
    pod_spec: Obj = {
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": [*volumes, *secret_volumes, {"name": "tmp", "emptyDir": {}},
                    {"name": "shm", "emptyDir": {"medium": "Memory"}}],
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = list(spec.tolerations)
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": f"{name}-engine", "namespace": ns, "labels": labels(name, "engine"),
                     "ownerReferences": [owner_reference(es)]},
        "spec": {
            "replicas": replicas,
            "serviceName": f"{name}-engine",
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(name, "engine")},
            "template": {"metadata": {"labels": labels(name, "engine")}, "spec": pod_spec},
        },
    }


def engine_configmap(es: EngineSet, replicas: int) -> Obj:
    """``DP_SIZE`` for the engine pods (read when a pod starts; the ranks that stay keep running)."""
    name, ns = es["metadata"]["name"], es["metadata"]["namespace"]
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{name}-engine", "namespace": ns, "labels": labels(name, "engine"),
                         "ownerReferences": [owner_reference(es)]},
            "data": {"DP_SIZE": str(replicas)}}


def engine_service(es: EngineSet) -> Obj:
    name, ns = es["metadata"]["name"], es["metadata"]["namespace"]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": f"{name}-engine", "namespace": ns, "labels": labels(name, "engine"),
                     "ownerReferences": [owner_reference(es)]},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector(name, "engine"),
                 "ports": [{"name": "grpc", "port": ENGINE_PORT, "targetPort": "grpc"},
                           {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}]},
    }


def router_deployment(es: EngineSet, spec: EngineSetSpec, service_account: str = "") -> Obj:
    """The router. With ``service_account`` (allowed to get/list/watch EngineSets: the chart's router
    Role) it follows this EngineSet's published rank table (``--engineset``); without, it starts on
    rank 0 and learns the others from the operator's SetRanks only."""
    name, ns = es["metadata"]["name"], es["metadata"]["namespace"]
    ranks = ["--engineset", name, "--namespace", ns] if service_account else ["--engines", rank_address(name, ns, 0)]
    args = ["router", *ranks, "--host", "0.0.0.0", "--port", str(ROUTER_PORT), "--http-port", str(spec.router_http_port),
            "--dispatch", spec.dispatch, "--engine-wait", "3600", "--metrics-port", str(METRICS_PORT),
            "--admin-port", str(ROUTER_ADMIN_PORT), "--max-queued-requests", str(spec.max_queued_requests),
            "--max-streams-per-connection", str(spec.max_streams_per_connection),
            *sec.tls_args(spec, sec.ROUTER_HEALTH_PORT), *sec.api_key_args(spec)]
    if spec.dp_lockstep:
        args.append("--dp-lockstep")
    container: Obj = {
        "name": "router",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": args,
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "MODESERVE_ENGINESET", "value": name},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": "k8s.pod.name=$(POD_NAME)"},
                *_tracing_env(spec, f"{name}-router")],
        "ports": [{"name": "grpc", "containerPort": ROUTER_PORT}, {"name": "http", "containerPort": spec.router_http_port},
                  {"name": "admin", "containerPort": ROUTER_ADMIN_PORT}, {"name": "metrics", "containerPort": METRICS_PORT}],
        # /health: 200 while a rank is ready and the router is not draining (the same for both APIs;
        # open without the API key; under TLS the kubelet does not verify the certificate)
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http",
                                       **({"scheme": "HTTPS"} if spec.tls_secret else {})}, "periodSeconds": 5},
        "livenessProbe": {"grpc": {"port": sec.probe_port(spec, ROUTER_PORT, sec.ROUTER_HEALTH_PORT), "service": ""},
                          "periodSeconds": 10, "initialDelaySeconds": 30, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    volumes, mounts = _model_volume(spec)  # the router loads the tokenizer from the model folder
    secret_volumes, secret_mounts = sec.secret_volumes(spec, api_key=True)
    container["volumeMounts"] += [*mounts, *secret_mounts]
    pod_spec: Obj = {"securityContext": _pod_security(), "containers": [container],
                     "volumes": [*volumes, *secret_volumes, {"name": "tmp", "emptyDir": {}}]}
    if service_account:
        pod_spec = {"serviceAccountName": service_account, **pod_spec}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": f"{name}-router", "namespace": ns, "labels": labels(name, "router"),
                     "ownerReferences": [owner_reference(es)]},
        "spec": {
            "replicas": spec.router_replicas,
            "selector": {"matchLabels": selector(name, "router")},
            "template": {"metadata": {"labels": labels(name, "router")}, "spec": pod_spec},
        },
    }


def engine_network_policy(es: EngineSet, spec: EngineSetSpec) -> Obj:
    """Who may reach the engines: the engine port (a Forward stream decides which KV slots are written)
    only from this EngineSet's router pods, the metrics port only from the monitoring namespaces."""
    name, ns = es["metadata"]["name"], es["metadata"]["namespace"]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-engine", "namespace": ns, "labels": labels(name, "engine"),
                     "ownerReferences": [owner_reference(es)]},
        "spec": {"podSelector": {"matchLabels": selector(name, "engine")}, "policyTypes": ["Ingress"],
                 "ingress": [
                     {"from": [{"podSelector": {"matchLabels": selector(name, "router")}}],
                      "ports": [{"protocol": "TCP", "port": ENGINE_PORT}]},
                     {"from": [{"namespaceSelector": {"matchLabels": dict(spec.metrics_namespace_selector)}}],
                      "ports": [{"protocol": "TCP", "port": METRICS_PORT}]}]},
    }


def router_service(es: EngineSet) -> Obj:
    name, ns = es["metadata"]["name"], es["metadata"]["namespace"]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels(name, "router"),
                     "ownerReferences": [owner_reference(es)]},
        "spec": {"selector": selector(name, "router"),
                 "ports": [{"name": "grpc", "port": ROUTER_PORT, "targetPort": "grpc", "appProtocol": "grpc"},
                           {"name": "http", "port": ROUTER_HTTP_PORT, "targetPort": "http", "appProtocol": "http"},
                           {"name": "admin", "port": ROUTER_ADMIN_PORT, "targetPort": "admin", "appProtocol": "grpc"},
                           {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}]},
    }
