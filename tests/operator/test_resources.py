"""What the operator creates for an EngineSet: valid Kubernetes objects (official schemas, strict)
with the ranks, probes, drain hook and ownership the design asks for; invalid specs are refused
with every problem named."""

from __future__ import annotations

import re

import pytest
import kubernetes_validate

from modeserve.operator import resources as res
from modeserve.operator.spec import InvalidSpec, parse_spec
from modeserve.service.cli import build_parser
from tests.k8s.test_chart import SAMPLE

ES = {**SAMPLE, "metadata": {"name": "llama", "namespace": "serving", "uid": "1234-abcd", "generation": 3}}


def objects(replicas: int = 2) -> list[dict]:
    spec = parse_spec(ES["spec"], default_image="ghcr.io/modeserve/modeserve:0.1.0")
    return [res.engine_statefulset(ES, spec, replicas), res.engine_service(ES), res.router_deployment(ES, spec),
            res.router_service(ES), res.engine_configmap(ES, replicas)]


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.34.0"])
def test_owned_objects_validate_strict(k8s_version: str) -> None:
    for obj in objects():
        kubernetes_validate.validate(obj, k8s_version, strict=True)
        assert obj["metadata"]["ownerReferences"] == [{"apiVersion": "modeserve.io/v1alpha1", "kind": "EngineSet",
                                                       "name": "llama", "uid": "1234-abcd", "controller": True,
                                                       "blockOwnerDeletion": True}]


def test_engine_statefulset_ranks_probes_and_drain() -> None:
    sts = objects(replicas=3)[0]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["DP_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["DP_SIZE"]["valueFrom"]["configMapKeyRef"] == {"name": "llama-engine", "key": "DP_SIZE"}
    assert res.engine_configmap(ES, 3)["data"] == {"DP_SIZE": "3"}
    # the template does not depend on the size: scaling does not restart the ranks that stay
    spec = parse_spec(ES["spec"], default_image="img")
    assert res.engine_statefulset(ES, spec, 2)["spec"]["template"] == res.engine_statefulset(ES, spec, 5)["spec"]["template"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel:4317"
    assert c["readinessProbe"]["grpc"] == {"port": res.ENGINE_PORT, "service": "modeserve.v1.Engine"}
    assert c["livenessProbe"]["grpc"]["service"] == ""
    assert c["lifecycle"]["preStop"]["exec"]["command"][:2] == ["modeserve", "drain"]
    assert pod["terminationGracePeriodSeconds"] == 120
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["runAsNonRoot"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    # the engine's command line is one the real CLI accepts
    args = [a.replace("$(DP_RANK)", "1") for a in c["args"]]
    parsed = build_parser().parse_args(args)
    assert (parsed.model, parsed.dp_rank, parsed.page_size, parsed.enable_mixed, parsed.device, parsed.metrics_port) == (
        "/models/llama-3.1-8b", 1, 16, True, "cuda", res.METRICS_PORT)


def test_router_points_at_rank_zero_and_serves_generate() -> None:
    _, headless, router, service, _ = objects()
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    pod = router["spec"]["template"]["spec"]
    c = pod["containers"][0]
    parsed = build_parser().parse_args(c["args"])
    assert parsed.engines == "llama-engine-0.llama-engine.serving.svc:50061" and parsed.dispatch == "prefix"
    assert parsed.engineset is None and "serviceAccountName" not in pod  # no rights to read EngineSets
    assert parsed.metrics_port == res.METRICS_PORT
    assert parsed.http_port == res.ROUTER_HTTP_PORT
    assert parsed.admin_port == res.ROUTER_ADMIN_PORT  # the operator's Admin calls, apart from Generate
    admin = next(p for p in service["spec"]["ports"] if p["name"] == "admin")
    assert (admin["port"], admin["targetPort"]) == (res.ROUTER_ADMIN_PORT, "admin")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"} and ports["http"] == parsed.http_port
    names = [e["name"] for e in c["env"]]  # the kubelet expands $(VAR) only for variables defined before
    assert c["env"][names.index("OTEL_RESOURCE_ATTRIBUTES")]["value"] == "k8s.pod.name=$(POD_NAME)"
    assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert service["metadata"]["name"] == "llama" and service["spec"]["ports"][0]["port"] == 50051
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    assert (http["port"], http["targetPort"]) == (res.ROUTER_HTTP_PORT, "http")


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.34.0"])
def test_router_with_a_service_account_follows_its_engineset(k8s_version: str) -> None:
    spec = parse_spec(ES["spec"], default_image="img")
    router = res.router_deployment(ES, spec, "rel-modeserve-router")
    kubernetes_validate.validate(router, k8s_version, strict=True)
    pod = router["spec"]["template"]["spec"]
    parsed = build_parser().parse_args(pod["containers"][0]["args"])
    assert (parsed.engineset, parsed.namespace, parsed.engines) == ("llama", "serving", None)
    assert pod["serviceAccountName"] == "rel-modeserve-router"


def test_invalid_spec_names_every_problem() -> None:
    bad = {"model": {"path": "", "pvc": "a", "hostPath": "/b"}, "engine": {"page_sise": "16", "device": "tpu"},
           "router": {"dispatch": "random"}, "resources": {"limits": {"memory": "lots"}}, "tensorParallelSize": 0}
    with pytest.raises(InvalidSpec) as err:
        parse_spec(bad, default_image="img")
    msg = str(err.value)
    for needle in ("spec.model.path", "pvc or hostPath", "page_sise", "device", "dispatch", "memory",
                   "tensorParallelSize must be >= 1"):
        assert needle in msg, needle


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.34.0"])
def test_tensor_parallel_pods_get_a_gpu_a_rank(k8s_version: str) -> None:
    """tensorParallelSize 2: one pod a DP rank still, 2 GPUs in it (by default), the engine started with
    2 tensor-parallel ranks, a command line the real CLI accepts."""
    es = {**ES, "spec": {**ES["spec"], "tensorParallelSize": 2, "resources": {"limits": {"memory": "64Gi"}}}}
    spec = parse_spec(es["spec"], default_image="img")
    sts = res.engine_statefulset(es, spec, 3)
    kubernetes_validate.validate(sts, k8s_version, strict=True)
    assert sts["spec"]["replicas"] == 3
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "2"}
    parsed = build_parser().parse_args([a.replace("$(DP_RANK)", "0") for a in c["args"]])
    assert (parsed.tensor_parallel_size, parsed.device) == (2, "cuda")
    one = res.engine_statefulset(ES, parse_spec(ES["spec"], default_image="img"), 3)["spec"]["template"]["spec"]
    assert "--tensor-parallel-size" not in one["containers"][0]["args"]


@pytest.mark.parametrize("change, needle", [
    ({"resources": {"limits": {"nvidia.com/gpu": 1}}}, "nvidia.com/gpu '1' must equal spec.tensorParallelSize 2"),
    ({"model": {"path": "m", "attentionHeads": 9}}, "tensorParallelSize 2 must divide spec.model.attentionHeads (9)"),
    ({"engine": {"device": "cpu"}, "resources": {"limits": {"nvidia.com/gpu": 2}}}, "spec.engine.device is not cuda"),
    ({"engine": {"device": "cuda", "tensor_parallel_size": "2"}}, "set spec.tensorParallelSize instead"),
])
def test_tensor_parallel_combinations_that_cannot_run_are_named(change: dict, needle: str) -> None:
    with pytest.raises(InvalidSpec, match=re.escape(needle)):
        parse_spec({**ES["spec"], "tensorParallelSize": 2, **change}, default_image="img")


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.34.0"])
def test_network_policy_admits_only_this_enginesets_routers_to_the_engines(k8s_version: str) -> None:
    spec = parse_spec(ES["spec"], default_image="img")
    policy = res.engine_network_policy(ES, spec)
    kubernetes_validate.validate(policy, k8s_version, strict=True)
    engine_pods = res.engine_statefulset(ES, spec, 2)["spec"]["template"]["metadata"]["labels"]
    router_pods = res.router_deployment(ES, spec)["spec"]["template"]["metadata"]["labels"]
    body = policy["spec"]
    assert body["policyTypes"] == ["Ingress"]  # everything not listed is refused
    assert body["podSelector"]["matchLabels"].items() <= engine_pods.items()
    assert not body["podSelector"]["matchLabels"].items() <= router_pods.items()
    engine_rule, metrics_rule = body["ingress"]
    (peer,) = engine_rule["from"]
    assert list(peer) == ["podSelector"] and peer["podSelector"]["matchLabels"].items() <= router_pods.items()
    assert peer["podSelector"]["matchLabels"]["modeserve.io/engineset"] == "llama"  # not another EngineSet's
    assert engine_rule["ports"] == [{"protocol": "TCP", "port": res.ENGINE_PORT}]
    (monitoring,) = metrics_rule["from"]
    assert monitoring == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert metrics_rule["ports"] == [{"protocol": "TCP", "port": res.METRICS_PORT}]
    custom = parse_spec({**ES["spec"], "networkPolicy": {"metricsNamespaceSelector": {"team": "obs"}}}, "img")
    assert res.engine_network_policy(ES, custom)["spec"]["ingress"][1]["from"][0]["namespaceSelector"] == {
        "matchLabels": {"team": "obs"}}
    assert parse_spec({**ES["spec"], "networkPolicy": {"enabled": False}}, "img").network_policy is False


def test_router_http_port_follows_the_spec() -> None:
    spec = parse_spec({**ES["spec"], "router": {"httpPort": 8080}}, default_image="img")
    c = res.router_deployment(ES, spec)["spec"]["template"]["spec"]["containers"][0]
    assert build_parser().parse_args(c["args"]).http_port == 8080
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == 8080
    with pytest.raises(InvalidSpec, match="httpPort"):
        parse_spec({**ES["spec"], "router": {"httpPort": 0}}, default_image="img")


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.34.0"])
def test_tls_and_api_key_flow_into_the_pods(k8s_version: str) -> None:
    """``spec.tls`` mounts the Secret in engines and routers and turns TLS on in both command lines
    (mutual to the engines, whose drain hook presents the pod's certificate); probes go to the
    plaintext health ports; ``spec.router.apiKey`` mounts the key's Secret for ``--api-key-file``.
    The command lines are ones the real CLI accepts, and the objects validate strictly."""
    from modeserve.operator import secure_serving as sec

    spec = parse_spec({**ES["spec"], "tls": {"enabled": True, "secretName": "llama-tls"},
                       "router": {"apiKey": {"secretName": "llama-key", "key": "token"}}}, "img")
    sts, router = res.engine_statefulset(ES, spec, 2), res.router_deployment(ES, spec)
    for obj in (sts, router):
        kubernetes_validate.validate(obj, k8s_version, strict=True)
    mount = {"name": "tls", "mountPath": "/etc/modeserve/tls", "readOnly": True}
    engine_pod = sts["spec"]["template"]["spec"]
    e = engine_pod["containers"][0]
    assert {"name": "tls", "secret": {"secretName": "llama-tls"}} in engine_pod["volumes"] and mount in e["volumeMounts"]
    parsed = build_parser().parse_args([a.replace("$(DP_RANK)", "0") for a in e["args"]])
    assert (parsed.tls_cert, parsed.tls_key, parsed.tls_ca, parsed.health_port) == (
        "/etc/modeserve/tls/tls.crt", "/etc/modeserve/tls/tls.key", "/etc/modeserve/tls/ca.crt", sec.ENGINE_HEALTH_PORT)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert e[probe]["grpc"]["port"] == sec.ENGINE_HEALTH_PORT != res.ENGINE_PORT
    drain = build_parser().parse_args(e["lifecycle"]["preStop"]["exec"]["command"][1:])
    assert (drain.server, drain.tls_ca, drain.tls_cert, drain.tls_key) == (
        f"localhost:{res.ENGINE_PORT}", parsed.tls_ca, parsed.tls_cert, parsed.tls_key)
    router_pod = router["spec"]["template"]["spec"]
    r = router_pod["containers"][0]
    parsed = build_parser().parse_args(r["args"])
    assert (parsed.tls_cert, parsed.tls_ca, parsed.health_port) == (
        "/etc/modeserve/tls/tls.crt", "/etc/modeserve/tls/ca.crt", sec.ROUTER_HEALTH_PORT)
    assert parsed.api_key_file == "/etc/modeserve/api-key/api-key" and parsed.api_key is None
    assert {"name": "api-key", "secret": {"secretName": "llama-key", "items": [{"key": "token", "path": "api-key"}]}} \
        in router_pod["volumes"]
    assert mount in r["volumeMounts"] and {"name": "api-key", "mountPath": "/etc/modeserve/api-key",
                                           "readOnly": True} in r["volumeMounts"]
    assert r["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert r["livenessProbe"]["grpc"]["port"] == sec.ROUTER_HEALTH_PORT
    assert "api-key" not in {v["name"] for v in engine_pod["volumes"]}  # the engines never see the key
    with pytest.raises(InvalidSpec, match="secretName"):
        parse_spec({**ES["spec"], "tls": {"enabled": True}}, "img")
    with pytest.raises(InvalidSpec, match="apiKey"):
        parse_spec({**ES["spec"], "router": {"apiKey": {"key": "token"}}}, "img")


def test_router_limits_follow_the_spec() -> None:
    """``spec.router.limits``: the router's queue and streams per connection, on its command line."""
    default = build_parser().parse_args(res.router_deployment(ES, parse_spec(ES["spec"], "img"))["spec"]["template"]
                                        ["spec"]["containers"][0]["args"])
    assert (default.max_queued_requests, default.max_streams_per_connection) == (1024, 4096)
    spec = parse_spec({**ES["spec"], "router": {"limits": {"maxQueuedRequests": 64, "maxStreamsPerConnection": 8}}},
                      "img")
    c = res.router_deployment(ES, spec)["spec"]["template"]["spec"]["containers"][0]
    parsed = build_parser().parse_args(c["args"])
    assert (parsed.max_queued_requests, parsed.max_streams_per_connection) == (64, 8)
    with pytest.raises(InvalidSpec, match="maxQueuedRequests"):
        parse_spec({**ES["spec"], "router": {"limits": {"maxQueuedRequests": 0}}}, "img")
