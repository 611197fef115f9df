"""``modeserve operator``: the Helm chart's operator Deployment runs a command line the CLI accepts,
and the config built from it (and the Deployment's env) is what the chart asks for."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeserve.operator.reconcile import OperatorConfig
from modeserve.service.cli import build_parser
from modeserve.operator.cli import build_config
from tests.k8s.test_chart import helm, render  # noqa: F401  (helm is a fixture)


def test_chart_operator_command_line_is_accepted(helm: Path) -> None:  # noqa: F811
    objs = render(helm, "operator.watchNamespaces={team-a,team-b}", "operator.reconcileInterval=20")
    operator = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-operator"))
    container = operator["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    env = {e["name"]: e["value"] for e in container["env"]}
    config = build_config(args, env)
    assert config.namespaces == ("team-a", "team-b") and config.reconcile_interval == 20
    assert config.default_image == env["MODESERVE_IMAGE"] != ""
    assert config.default_image_pull_policy == env["MODESERVE_IMAGE_PULL_POLICY"]
    assert args.operator_log_level == "INFO"
    # routers run as the chart's router ServiceAccount, which may read EngineSets in each namespace
    assert config.router_service_account == "rel-modeserve-router"
    for ns in ("team-a", "team-b"):
        account = next(o for o in objs if o["kind"] == "ServiceAccount" and o["metadata"]["namespace"] == ns)
        binding = next(o for o in objs if o["kind"] == "RoleBinding" and o["metadata"]["namespace"] == ns
                       and o["metadata"]["name"].endswith("-router"))
        assert account["metadata"]["name"] == config.router_service_account
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": config.router_service_account,
                                        "namespace": ns}]
    probe = container["livenessProbe"]["httpGet"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe["port"])
    assert args.liveness.endswith(f":{port}{probe['path']}")


def test_operator_config_is_validated() -> None:
    args = build_parser().parse_args(["operator", "--namespaces", " , "])
    with pytest.raises(ValueError, match="namespaces"):
        build_config(args, {})
    with pytest.raises(ValueError, match="> 0"):
        OperatorConfig(namespaces=("a",), reconcile_interval=0)
