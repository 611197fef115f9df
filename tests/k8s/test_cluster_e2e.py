"""End to end on a real cluster (marked ``k8s``; skipped when none is reachable): install the chart
with a sample EngineSet, send a request through its router, scale 1 -> 2 -> 1 with ``kubectl scale``
while streams run, and check that every stream completed with all its tokens.

Run it against kind (see README): MODESERVE_IMAGE=<image loaded into the cluster> KUBECONFIG=... \
    .venv/bin/python -P -m pytest -q -m k8s tests/k8s/test_cluster_e2e.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.k8s.tools import helm_binary, kubectl_binary

pytestmark = pytest.mark.k8s
CHART = Path(__file__).resolve().parents[2] / "helm" / "modeserve"


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    cache = tmp_path_factory.mktemp("k8s-tools")
    helm, kubectl = helm_binary(cache), kubectl_binary(cache)
    if not os.environ.get("KUBECONFIG") or not os.environ.get("MODESERVE_IMAGE"):
        pytest.skip("set KUBECONFIG (a reachable cluster) and MODESERVE_IMAGE (the image loaded into it)")
    if subprocess.run([str(kubectl), "version", "--request-timeout=5s"], capture_output=True).returncode != 0:
        pytest.skip("no Kubernetes cluster reachable through KUBECONFIG")
    return helm, kubectl


@pytest.fixture(scope="module")
def release(tools: tuple[Path, Path]) -> Iterator[dict[str, Any]]:
    helm, kubectl = tools
    ns = f"modeserve-e2e-{uuid.uuid4().hex[:6]}"
    repo, _, tag = os.environ["MODESERVE_IMAGE"].rpartition(":")
    subprocess.run([str(helm), "install", "e2e", str(CHART), "--namespace", ns, "--create-namespace", "--wait",
                    "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
                    "--set", "image.pullPolicy=IfNotPresent", "--set", "sampleEngineSet.enabled=true"], check=True)
    yield {"ns": ns, "kubectl": kubectl}
    subprocess.run([str(helm), "uninstall", "e2e", "--namespace", ns, "--wait"], check=False)
    subprocess.run([str(kubectl), "delete", "namespace", ns, "--wait=false"], check=False)


def engineset(rel: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run([str(rel["kubectl"]), "-n", rel["ns"], "get", "engineset", "demo", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def wait_ready(rel: dict[str, Any], replicas: int, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = engineset(rel).get("status", {})
        if status.get("readyReplicas") == replicas and status.get("replicas") == replicas:
            return
        time.sleep(2)
    raise AssertionError(f"EngineSet not at {replicas} ready ranks: {engineset(rel).get('status')}")


def test_install_request_and_scale_without_loss(release: dict[str, Any]) -> None:
    from modeserve.service.rpc.client import GenerateClient

    kubectl, ns = release["kubectl"], release["ns"]
    wait_ready(release, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forward = subprocess.Popen([str(kubectl), "-n", ns, "port-forward", "svc/demo", f"{port}:50051"])
    try:
        time.sleep(3)
        client = GenerateClient(f"127.0.0.1:{port}")
        first = client.generate(text="What is the capital of France?", chat=True, max_new_tokens=16)
        assert first.finish_reason in ("stop", "length") and first.token_ids
        with ThreadPoolExecutor(16) as pool:
            running = [pool.submit(client.generate, token_ids=[5 + i, 6, 7, 8], max_new_tokens=64, ignore_eos=True)
                       for i in range(16)]
            subprocess.run([str(kubectl), "-n", ns, "scale", "engineset/demo", "--replicas=2"], check=True)
            wait_ready(release, 2)
            later = [pool.submit(client.generate, token_ids=[9 + i, 6, 7], max_new_tokens=64, ignore_eos=True)
                     for i in range(16)]
            subprocess.run([str(kubectl), "-n", ns, "scale", "engineset/demo", "--replicas=1"], check=True)
            wait_ready(release, 1)
            outs = [f.result(timeout=600) for f in running + later]
        assert all(o.finish_reason == "length" and len(o.token_ids) == 64 for o in outs)  # nothing lost
        client.close()
    finally:
        forward.terminate()
