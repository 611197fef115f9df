"""The Helm chart with the real ``helm``: lint, render with default values and with every toggle on,
and validate what it renders against the official Kubernetes schemas (1.30 and 1.34, strict); the
EngineSet CRD's own schema accepts the sample and rejects broken ones."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.k8s.tools import helm_binary

CHART = Path(__file__).resolve().parents[2] / "helm" / "modeserve"
CRD = CHART / "crds" / "engineset.yaml"
TLS_ON = ["tls.enabled=true", "tls.certManager.enabled=true", "tls.certManager.issuerRef.name=modeserve-ca",
          "apiKey.secretName=demo-api-key"]
ALL_ON = ["sampleEngineSet.enabled=true", "autoscaling.hpa=true", "autoscaling.keda=true",
          "monitoring.serviceMonitor=true", "operator.watchNamespaces={team-a,team-b}", "serviceAccount.name=ms", *TLS_ON]
STANDARD_GROUPS = ("v1", "apps/v1", "rbac.authorization.k8s.io/v1", "autoscaling/v2", "apiextensions.k8s.io/v1")


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return helm_binary(tmp_path_factory.mktemp("helm"))


def render(helm: Path, *sets: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", "rel", str(CHART), "--namespace", "serving", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def check_engineset(obj: dict[str, Any]) -> None:
    """Validate against the CRD's structural schema (int-or-string as the API server reads it)."""
    schema = copy.deepcopy(crd_schema())
    jsonschema.validate(obj, schema)


def test_helm_lint_strict(helm: Path) -> None:
    for sets in ([], ALL_ON):
        args = [str(helm), "lint", "--strict", str(CHART)] + [a for s in sets for a in ("--set", s)]
        proc = subprocess.run(args, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.34.0"])
@pytest.mark.parametrize("sets", [[], ALL_ON], ids=["defaults", "all-on"])
def test_rendered_objects_validate_strict(helm: Path, k8s_version: str, sets: list[str]) -> None:
    objs = render(helm, *sets)
    kinds = {o["kind"] for o in objs}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole", "Role"} <= kinds
    for obj in objs:
        if obj["apiVersion"] in STANDARD_GROUPS:
            kubernetes_validate.validate(obj, k8s_version, strict=True)
        elif obj["kind"] == "EngineSet":
            check_engineset(obj)
        else:  # KEDA ScaledObject, ServiceMonitor, cert-manager Certificate: no official schema offline
            assert obj["kind"] in ("ScaledObject", "ServiceMonitor", "Certificate"), obj["kind"]
    if sets:
        assert {"EngineSet", "HorizontalPodAutoscaler", "ScaledObject", "ServiceMonitor", "Certificate"} <= kinds
        hpa = next(o for o in objs if o["kind"] == "HorizontalPodAutoscaler")
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "modeserve.io/v1alpha1", "kind": "EngineSet",
                                                 "name": "demo"}
        # the queue lives at the router: an object metric on its Service (named like the EngineSet)
        metric = hpa["spec"]["metrics"][0]["object"]
        assert metric["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": "demo"}
        assert metric["metric"]["name"] == "modeserve_queue_requests"
        roles = [o for o in objs if o["kind"] == "Role"]
        assert sorted((r["metadata"]["namespace"], r["metadata"]["name"]) for r in roles) == [
            ("team-a", "rel-modeserve-operator"), ("team-a", "rel-modeserve-router"),
            ("team-b", "rel-modeserve-operator"), ("team-b", "rel-modeserve-router")]


def test_operator_pod_is_locked_down_and_rbac_is_least_privilege(helm: Path) -> None:
    objs = render(helm)
    dep = next(o for o in objs if o["kind"] == "Deployment")
    sec = dep["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sec["runAsNonRoot"] and sec["readOnlyRootFilesystem"] and sec["capabilities"]["drop"] == ["ALL"]
    assert not sec["allowPrivilegeEscalation"]
    role = next(o for o in objs if o["kind"] == "Role" and o["metadata"]["name"].endswith("-operator"))
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert ("", "secrets", "get") not in granted and not any(v == "*" or r == "*" for _, r, v in granted)
    assert ("modeserve.io", "enginesets/status", "patch") in granted
    assert ("apps", "statefulsets", "delete") in granted  # cleanup of what it created
    assert ("networking.k8s.io", "networkpolicies", "create") in granted  # each EngineSet's engine policy
    # the routers read EngineSets in their namespace (to follow their rank table), nothing else
    router_role = next(o for o in objs if o["kind"] == "Role" and o["metadata"]["name"].endswith("-router"))
    assert router_role["rules"] == [{"apiGroups": ["modeserve.io"], "resources": ["enginesets"],
                                     "verbs": ["get", "list", "watch"]}]
    router_binding = next(o for o in objs if o["kind"] == "RoleBinding" and o["metadata"]["name"].endswith("-router"))
    assert router_binding["roleRef"]["name"] == router_role["metadata"]["name"]
    assert router_binding["subjects"][0]["name"] != dep["spec"]["template"]["spec"]["serviceAccountName"]
    cluster = next(o for o in objs if o["kind"] == "ClusterRole")
    assert cluster["rules"] == [{"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                                 "verbs": ["get", "list", "watch"]}]


def test_values_schema_rejects_bad_values(helm: Path) -> None:
    for bad in ("autoscaling.maxReplicas=0", "image.pullPolicy=Sometimes", "sampleEngineSet.name=Bad_Name",
                "nonsense=1", "router.serviceAccount.nonsense=1", "sampleEngineSet.routerHttpPort=70000"):
        proc = subprocess.run([str(helm), "template", "rel", str(CHART), "--set", bad], capture_output=True, text=True)
        assert proc.returncode != 0 and "schema" in proc.stderr.lower(), (bad, proc.stderr)


def test_routers_can_run_as_an_existing_service_account(helm: Path) -> None:
    proc = subprocess.run([str(helm), "template", "rel", str(CHART), "--set", "router.serviceAccount.create=false"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "router.serviceAccount.name" in proc.stderr
    objs = render(helm, "router.serviceAccount.create=false", "router.serviceAccount.name=mine")
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"] == ["rel-modeserve"]  # the operator's
    binding = next(o for o in objs if o["kind"] == "RoleBinding" and o["metadata"]["name"].endswith("-router"))
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "mine", "namespace": "serving"}]
    operator = next(o for o in objs if o["kind"] == "Deployment")
    assert "--router-service-account=mine" in operator["spec"]["template"]["spec"]["containers"][0]["args"]


def test_sample_engineset_serves_http_and_notes_show_a_first_curl(helm: Path) -> None:
    objs = render(helm, "sampleEngineSet.enabled=true", "sampleEngineSet.routerHttpPort=8080",
                  "sampleEngineSet.limits.maxQueuedRequests=77")
    sample = next(o for o in objs if o["kind"] == "EngineSet")
    assert sample["spec"]["router"]["httpPort"] == 8080
    assert sample["spec"]["router"]["limits"] == {"maxQueuedRequests": 77, "maxStreamsPerConnection": 4096}
    check_engineset(sample)
    out = subprocess.run([str(helm), "install", "rel", str(CHART), "--dry-run", "--namespace", "serving", "--set",
                          "sampleEngineSet.enabled=true"], capture_output=True, text=True, check=True).stdout
    notes = out[out.index("NOTES:"):]
    assert "port-forward svc/demo 8000:8000" in notes and "curl localhost:8000/v1/chat/completions" in notes


def test_tensor_parallel_sample_renders_pods_with_a_gpu_a_rank(helm: Path) -> None:
    """The real helm renders the sample EngineSet with tensorParallelSize 2; the operator turns it into
    engine pods of 2 GPUs starting 2 ranks."""
    from modeserve.operator import resources as res
    from modeserve.operator.spec import parse_spec

    objs = render(helm, "sampleEngineSet.enabled=true", "sampleEngineSet.tensorParallelSize=2",
                  "sampleEngineSet.engine.device=cuda")
    sample = next(o for o in objs if o["kind"] == "EngineSet")
    check_engineset(sample)
    assert sample["spec"]["tensorParallelSize"] == 2
    spec = parse_spec(sample["spec"], default_image="img")
    created = {**sample, "metadata": {**sample["metadata"], "uid": "uid-demo"}}  # as the API server stores it
    (c,) = res.engine_statefulset(created, spec, 1)["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"


def test_tls_and_api_key_values_flow_into_the_pods(helm: Path) -> None:
    """With TLS (a cert-manager Certificate) and an API key Secret: the Certificate names what its
    holders are reached by (the router Service, every engine pod, localhost for the drain hook) and is
    a client certificate too; the operator mounts it and calls routers over TLS; the sample
    EngineSet carries both, and the pods the operator makes from it get the flags and volumes."""
    from modeserve.operator import resources as res
    from modeserve.operator.router_client import router_address
    from modeserve.operator.spec import parse_spec
    from modeserve.service.cli import build_parser

    objs = render(helm, "sampleEngineSet.enabled=true", *TLS_ON)
    cert = next(o for o in objs if o["kind"] == "Certificate")
    names = set(cert["spec"]["dnsNames"])
    assert router_address("demo", "serving").rsplit(":", 1)[0] in names
    assert "*." + res.rank_address("demo", "serving", 3).split(".", 1)[1].rsplit(":", 1)[0] in names
    assert "localhost" in names and {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    assert cert["spec"]["issuerRef"]["name"] == "modeserve-ca"
    secret = cert["spec"]["secretName"]
    operator = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": secret}} in operator["volumes"]
    parsed = build_parser().parse_args(operator["containers"][0]["args"])
    assert (parsed.tls_ca, parsed.tls_cert, parsed.tls_key) == (
        "/etc/modeserve/tls/ca.crt", "/etc/modeserve/tls/tls.crt", "/etc/modeserve/tls/tls.key")
    sample = next(o for o in objs if o["kind"] == "EngineSet")
    check_engineset(sample)
    assert sample["spec"]["tls"] == {"enabled": True, "secretName": secret}
    es = {**sample, "metadata": {**sample["metadata"], "uid": "u"}}
    spec = parse_spec(sample["spec"], default_image="img")
    engine = res.engine_statefulset(es, spec, 1)["spec"]["template"]["spec"]
    router = res.router_deployment(es, spec)["spec"]["template"]["spec"]
    for pod in (engine, router):
        assert {"name": "tls", "secret": {"secretName": secret}} in pod["volumes"]
        assert "--tls-ca" in pod["containers"][0]["args"]
    router_args = build_parser().parse_args(router["containers"][0]["args"])
    assert router_args.api_key_file == "/etc/modeserve/api-key/api-key"
    assert {"name": "api-key", "secret": {"secretName": "demo-api-key", "items": [{"key": "api-key", "path": "api-key"}]}} \
        in router["volumes"]
    proc = subprocess.run([str(helm), "template", "rel", str(CHART), "--set", "tls.enabled=true"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "tls.secretName" in proc.stderr
    own = render(helm, "sampleEngineSet.enabled=true", "tls.enabled=true", "tls.secretName=mine")
    assert not any(o["kind"] == "Certificate" for o in own)
    assert next(o for o in own if o["kind"] == "EngineSet")["spec"]["tls"]["secretName"] == "mine"


def test_crd_has_scale_subresource_and_printer_columns() -> None:
    crd = yaml.safe_load(CRD.read_text())
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert [c["name"] for c in version["additionalPrinterColumns"]][:3] == ["Replicas", "Ready", "Model"]
    kubernetes_validate.validate(crd, "1.34.0", strict=True)


SAMPLE = {
    "apiVersion": "modeserve.io/v1alpha1", "kind": "EngineSet", "metadata": {"name": "llama", "namespace": "x"},
    "spec": {"replicas": 2, "model": {"path": "llama-3.1-8b", "pvc": "models"},
             "engine": {"device": "cuda", "page_size": "16", "enable_mixed": "true"},
             "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}},
             "router": {"dispatch": "prefix"}, "autoscaling": {"enabled": True, "maxReplicas": 8, "targetQueueDepth": 4},
             "tracing": {"enabled": True, "endpoint": "http://otel:4317"}},
}


@pytest.mark.parametrize("path, value", [
    (("spec", "replicas"), -1),
    (("spec", "model"), {}),
    (("spec", "router", "dispatch"), "random"),
    (("spec", "engine", "page_size"), 16),  # engine values are strings
    (("spec", "autoscaling", "targetKvCacheUsage"), 1.5),
    (("spec", "imagePullPolicy"), "Sometimes"),
    (("spec", "router", "httpPort"), 0),
])
def test_crd_schema_accepts_sample_and_rejects_broken(path: tuple[str, ...], value: Any) -> None:
    check_engineset(SAMPLE)
    broken = copy.deepcopy(SAMPLE)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        check_engineset(broken)
