"""The operator's Kubernetes API access: plain JSON objects over the ``kubernetes`` client's HTTP layer
(no generated models), so the objects the builders make go out unchanged.

Writes are JSON merge patches (``application/merge-patch+json``): a list is replaced as a whole, so
the operator's lists (containers, ports, env) are exactly what the builders produce, and a key a build
no longer has is patched away by ``apply`` (``operator.apply``: the last build rides on the object).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from .apply import annotated, merge_patch

Obj = dict[str, Any]
PLURALS = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Event": "events",
           "StatefulSet": "statefulsets",
           "Deployment": "deployments", "EngineSet": "enginesets", "NetworkPolicy": "networkpolicies"}
MERGE_PATCH = "application/merge-patch+json"


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None,
                subresource: str | None = None) -> str:
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{root}/namespaces/{quote(namespace)}/{PLURALS[kind]}"
    if name is not None:
        path += f"/{quote(name)}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


class Kube:
    """Synchronous (kopf runs sync handlers in worker threads); thread-safe like the client's pool."""

    def __init__(self, api_client: k8s.ApiClient) -> None:
        self.api = api_client

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account, else ``~/.kube/config`` (the same order kopf logs in with)."""
        try:
            k8s_config.load_incluster_config()
        except k8s_config.ConfigException:
            k8s_config.load_kube_config()
        return cls(k8s.ApiClient(k8s.Configuration.get_default_copy()))

    @classmethod
    def for_server(cls, server: str) -> Kube:
        """An API server without authentication (tests, ``kubectl proxy``)."""
        return cls(k8s.ApiClient(k8s.Configuration(host=server.rstrip("/"))))

    def request(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
                content_type: str = "application/json") -> Obj:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        params = self.api.param_serialize(method=method, resource_path=path, query_params=query or [],
                                          header_params=headers, body=body, auth_settings=["BearerToken"])
        response = self.api.call_api(*params, _request_timeout=30)
        response.read()
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        return json.loads(response.data or b"{}")

    # ---- object verbs (404 is an answer, not an error) ----------------------------------------
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        try:
            return self.request("GET", object_path(api_version, kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> list[Obj]:
        """Objects carrying every label in ``labels`` (also checked here: the selector is a request)."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        items = self.request("GET", object_path(api_version, kind, namespace),
                             query=[("labelSelector", selector)]).get("items") or []
        return [o for o in items
                if all(((o.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())]

    def create(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        return self.request("POST", object_path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj)

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: Obj,
              subresource: str | None = None) -> Obj:
        return self.request("PATCH", object_path(api_version, kind, namespace, name, subresource), body=patch,
                            content_type=MERGE_PATCH)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """False when it was already gone."""
        try:
            self.request("DELETE", object_path(api_version, kind, namespace, name),
                         body={"propagationPolicy": "Background"})
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def apply(self, obj: Obj) -> tuple[Obj, str]:
        """Create ``obj`` or merge-patch it in, removing what the last applied build had and ``obj`` has
        not (``operator.apply``); ("created" | "patched" | "unchanged") beside the result."""
        meta = obj["metadata"]
        existing = self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if existing is None:
            return self.create(annotated(obj)), "created"
        patch = merge_patch(existing, obj)
        if patch is None:
            return existing, "unchanged"
        return self.patch(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], patch), "patched"
