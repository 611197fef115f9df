"""What the operator's kmock tests share: kmock's Kubernetes emulator with the versions kopf relies
on (``VersionedEmulator``), a fake router behind the ``AdminClient`` interface (``FakeRouter``), and the
``Harness`` the tests drive them with (the ``harness`` fixture, in this folder's ``conftest.py``, runs
the operator against them).

kopf runs in its own thread and event loop (as ``kopf.testing.KopfRunner`` does), so the test's loop
keeps serving kmock while the operator's sync handlers call it. kmock is an emulator, not a cluster:
no controllers (the test creates and changes the engine pods itself), no label-selector filtering
(the operator filters pods itself), no garbage collection (the operator deletes what it owns), and
``/scale`` is a plain merge of the Scale body into the EngineSet (right here: ``specReplicasPath`` is
``.spec.replicas``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import attrs
import jsonpatch
import kmock

from modeserve.operator import resources as res
from modeserve.operator.ranks import RouterRank
from modeserve.operator.router_client import RouterStates, RouterUnreachable

NS = "serving"
NAME = "llama"
ES = "modeserve.io/v1alpha1/enginesets"
STS = "apps/v1/statefulsets"
ES_PATH = f"/apis/modeserve.io/v1alpha1/namespaces/{NS}/enginesets"
POD_PATH = f"/api/v1/namespaces/{NS}/pods"
MERGE = {"Content-Type": "application/merge-patch+json"}
RESOURCES = {ES: "EngineSet", STS: "StatefulSet", "apps/v1/deployments": "Deployment", "v1/services": "Service",
             "v1/configmaps": "ConfigMap",
             "v1/pods": "Pod", "v1/events": "Event", "v1/namespaces": "Namespace"}
OWNED = [(STS, f"{NAME}-engine"), ("apps/v1/deployments", f"{NAME}-router"), ("v1/services", NAME),
         ("v1/services", f"{NAME}-engine"), ("v1/configmaps", f"{NAME}-engine"),
         ("networking.k8s.io/v1/networkpolicies", f"{NAME}-engine")]


@attrs.define(kw_only=True)
class VersionedEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what kopf's bookkeeping relies on: ``metadata.resourceVersion`` changes
    on every write, ``metadata.generation`` on every spec write, a JSON patch whose ``test`` of the
    resourceVersion fails is a 422, and ``generateName`` names a new object. (kmock 0.8 keeps the
    versions it is given, so kopf would take its own earlier events for new ones and re-run handlers;
    answers a failed test with a 500, which kopf retries unchanged; and stores every generated-name
    Event under the same empty name.)"""
    _revision: int = attrs.field(default=1, init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            self._stamp(request)  # in place: the request is frozen, its parsed body is not
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as exc:  # the API server's answer to a stale "test" op
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc

    def _stamp(self, request: kmock.Request) -> None:
        self._revision += 1
        version = str(self._revision)
        if request.action == kmock.action.CREATE:
            meta = request.data.setdefault("metadata", {})
            if "name" not in meta and "generateName" in meta:  # kopf's Events
                meta["name"] = f"{meta['generateName']}{version}"
            meta.setdefault("generation", 1)
            meta["resourceVersion"] = version
            return
        key: Any = (request.resource, request.namespace, request.name)
        current = self.objects[key].raw if key in self.objects and not self.objects[key].deleted else {}
        generation = int((current.get("metadata") or {}).get("generation") or 1)
        if isinstance(request.data, list):  # JSON patch
            request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
            if any(str(op.get("path", "")).startswith("/spec") for op in request.data):
                request.data.append({"op": "add", "path": "/metadata/generation", "value": generation + 1})
            return
        meta = request.data.setdefault("metadata", {})
        meta["resourceVersion"] = version
        if "spec" in request.data and request.subresource != "status":
            meta["generation"] = generation + 1


def read(kmock: Any, resource: str, name: str) -> dict[str, Any] | None:
    """The object's current state as plain JSON (None: never created, or deleted)."""
    key = (kmock.resource(resource), None if resource == "v1/namespaces" else NS, name)  # parsed: `in` hashes
    if key not in kmock.objects or kmock.objects[key].deleted:
        return None
    return copy.deepcopy(kmock.objects[key].raw)


@dataclass
class RouterCall:
    method: str                        # GetRanks | SetRanks
    ranks: list[RouterRank]            # SetRanks' argument
    requests_before: int               # kmock requests seen when it was called (orders calls vs HTTP)
    statefulset_replicas: int | None   # the StatefulSet's replicas at that moment


class FakeRouter:
    """The router's rank table, as ``service.rank_table`` keeps it: a new rank is READY at once, a
    draining one DRAINING until the test lets it drain (``drained``), a left-out one is removed."""

    def __init__(self, kmock: Any) -> None:
        self.kmock = kmock
        self.lock = threading.Lock()
        self.calls: list[RouterCall] = []
        self.table: dict[int, tuple[str, str]] = {}  # rank -> (address, state)
        self.drained: set[int] = set()
        self.reachable = True

    def _record(self, method: str, ranks: Sequence[RouterRank] = ()) -> None:
        sts = read(self.kmock, STS, f"{NAME}-engine")
        self.calls.append(RouterCall(method, list(ranks), sum(1 for _ in self.kmock),
                                     None if sts is None else sts["spec"]["replicas"]))

    def _states(self) -> RouterStates:
        return {r: ("DRAINED" if state == "DRAINING" and r in self.drained else state)
                for r, (_, state) in self.table.items()}

    def get_ranks(self, address: str, tls: bool = False) -> RouterStates:
        assert address == f"{NAME}.{NS}.svc:50053"
        with self.lock:
            if not self.reachable:
                raise RouterUnreachable("connection refused")
            self._record("GetRanks")
            return self._states()

    def set_ranks(self, address: str, ranks: Sequence[RouterRank], tls: bool = False) -> RouterStates:
        with self.lock:
            if not self.reachable:
                raise RouterUnreachable("connection refused")
            self._record("SetRanks", ranks)
            self.table = {r.rank: (r.address, "DRAINING" if r.draining else "READY") for r in ranks}
            return self._states()

    def set_calls(self) -> list[RouterCall]:
        with self.lock:
            return [c for c in self.calls if c.method == "SetRanks"]


@dataclass
class Harness:
    kmock: Any
    router: FakeRouter

    async def create(self, **spec: Any) -> None:
        body = {"apiVersion": "modeserve.io/v1alpha1", "kind": "EngineSet",
                "metadata": {"name": NAME, "namespace": NS, "uid": "uid-llama"},
                "spec": {"model": {"path": "/models/smollm2.gguf"}, "replicas": 2, **spec}}
        resp = await self.kmock.post(ES_PATH, json=body)
        assert resp.status < 300, await resp.text()

    async def add_pod(self, rank: int, ready: bool = True, name: str = NAME) -> None:
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{name}-engine-{rank}", "namespace": NS,
                            "labels": {**res.labels(name, "engine"), res.POD_INDEX_LABEL: str(rank)}},
               "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}],
                          "containerStatuses": [{"name": "engine", "ready": ready, "started": True}]}}
        resp = await self.kmock.post(POD_PATH, json=pod)
        assert resp.status < 300, await resp.text()

    async def patch(self, path: str, body: dict[str, Any]) -> None:
        resp = await self.kmock.patch(path, data=json.dumps(body), headers=MERGE)
        assert resp.status < 300, await resp.text()

    def engineset(self) -> dict[str, Any]:
        return read(self.kmock, ES, NAME) or {}

    def statefulset(self) -> dict[str, Any] | None:
        return read(self.kmock, STS, f"{NAME}-engine")

    def replicas(self) -> int | None:
        sts = self.statefulset()
        return None if sts is None else sts["spec"]["replicas"]

    def condition(self, type_: str) -> dict[str, Any]:
        conds = (self.engineset().get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == type_), {})

    def ranks(self) -> list[dict[str, Any]]:
        return (self.engineset().get("status") or {}).get("ranks") or []

    def events(self) -> list[tuple[str, str]]:
        """(reason, message) of the Events posted about the EngineSet."""
        found = []
        for key, obj in list(self.kmock.objects.items()):
            if key[0] == "v1/events" and not obj.deleted and obj.raw["involvedObject"].get("name") == NAME:
                found.append((obj.raw["reason"], obj.raw["message"]))
        return found


async def eventually(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    """Poll ``check`` (the operator reconciles every 0.2 s) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except (KeyError, StopIteration, TypeError):
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {getattr(check, '__name__', check)}")
        await asyncio.sleep(0.05)
