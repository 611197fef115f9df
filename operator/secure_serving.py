"""What TLS and the API key of an EngineSet add to its pods (pure functions of the spec).

With ``spec.tls`` the Secret (``tls.crt``, ``tls.key``, ``ca.crt``) is mounted read-only in the
engine and router pods: engines serve mutual TLS (only clients with a certificate the CA signed, the
routers and the drain hook, get in), routers serve TLS and present the certificate to the engines.
Its certificate must name the router Service (``NAME.NS.svc``), the engine pods
(``*.NAME-engine.NS.svc``) and ``localhost`` (the engines' preStop drain). The kubelet's gRPC
probes speak no TLS: they ask a plaintext port serving only health (``--health-port``), which a
NetworkPolicy does not block (traffic from a pod's own node is always allowed).
With ``spec.router.apiKey`` the routers ask for the key in that Secret (``--api-key-file``).
"""

from __future__ import annotations

from typing import Any

from .spec import EngineSetSpec

TLS_MOUNT = "/etc/modeserve/tls"
API_KEY_MOUNT = "/etc/modeserve/api-key"
ENGINE_HEALTH_PORT = 50062
ROUTER_HEALTH_PORT = 50052

Obj = dict[str, Any]


def tls_args(spec: EngineSetSpec, health_port: int) -> list[str]:
    """The TLS flags of an engine or router (the same files: the CA verifies the peer both ways)."""
    if spec.tls_secret is None:
        return []
    return ["--tls-cert", f"{TLS_MOUNT}/tls.crt", "--tls-key", f"{TLS_MOUNT}/tls.key", "--tls-ca", f"{TLS_MOUNT}/ca.crt",
            "--health-port", str(health_port)]


def drain_tls_args(spec: EngineSetSpec) -> list[str]:
    """``modeserve drain``'s flags against its own engine (mutual TLS: it presents the pod's certificate)."""
    if spec.tls_secret is None:
        return []
    return ["--tls-ca", f"{TLS_MOUNT}/ca.crt", "--tls-cert", f"{TLS_MOUNT}/tls.crt", "--tls-key", f"{TLS_MOUNT}/tls.key"]


def probe_port(spec: EngineSetSpec, port: int, health_port: int) -> int:
    """Where the kubelet's gRPC probes ask: the server's own port, or its plaintext health port under TLS."""
    return port if spec.tls_secret is None else health_port


def api_key_args(spec: EngineSetSpec) -> list[str]:
    return [] if spec.api_key_secret is None else ["--api-key-file", f"{API_KEY_MOUNT}/api-key"]


def secret_volumes(spec: EngineSetSpec, api_key: bool) -> tuple[list[Obj], list[Obj]]:
    """(volumes, mounts) of the TLS Secret and, with ``api_key`` (the routers), the API key's."""
    volumes: list[Obj] = []
    mounts: list[Obj] = []
    if spec.tls_secret is not None:
        volumes.append({"name": "tls", "secret": {"secretName": spec.tls_secret}})
        mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
    if api_key and spec.api_key_secret is not None:
        volumes.append({"name": "api-key", "secret": {
            "secretName": spec.api_key_secret, "items": [{"key": spec.api_key_secret_key, "path": "api-key"}]}})
        mounts.append({"name": "api-key", "mountPath": API_KEY_MOUNT, "readOnly": True})
    return volumes, mounts
