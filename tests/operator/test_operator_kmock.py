"""The operator end to end against kmock's Kubernetes emulator (real HTTP from kopf and from the
``kubernetes`` client), with a fake router behind the ``AdminClient`` interface.

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
import functools
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import attrs
import jsonpatch
import kmock
import kopf
import pytest
import pytest_asyncio

from modeserve.operator import resources as res
from modeserve.operator.handlers import create_registry, operator_settings
from modeserve.operator.kube import Kube
from modeserve.operator.ranks import RouterRank
from modeserve.operator.reconcile import EngineSetReconciler, OperatorConfig
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
         ("v1/services", f"{NAME}-engine"), ("v1/configmaps", f"{NAME}-engine")]


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


pytestmark = [pytest.mark.asyncio, pytest.mark.kmock(cls=VersionedEmulator)]


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

    def get_ranks(self, address: str) -> RouterStates:
        assert address == f"{NAME}.{NS}.svc:50051"
        with self.lock:
            if not self.reachable:
                raise RouterUnreachable("connection refused")
            self._record("GetRanks")
            return self._states()

    def set_ranks(self, address: str, ranks: Sequence[RouterRank]) -> RouterStates:
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


@pytest_asyncio.fixture
async def harness(kmock: Any) -> AsyncIterator[Harness]:
    for resource, kind in RESOURCES.items():
        kmock.resources[resource] = kmock.ResourceInfo(
            kind=kind, namespaced=kind != "Namespace", verbs={"get", "list", "watch", "create", "patch", "delete"},
            subresources={"status", "scale"} if kind == "EngineSet" else set())
    kmock.objects["v1/namespaces", None, NS] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    url = str(kmock.url).rstrip("/")
    config = OperatorConfig(namespaces=(NS,), reconcile_interval=0.2, default_image="modeserve:test",
                            router_retry_delay=0.2, router_service_account="modeserve-router")
    router = FakeRouter(kmock)
    registry = create_registry(EngineSetReconciler(config, Kube.for_server(url), router),
                               login=lambda **_: kopf.ConnectionInfo(server=url))
    stop = threading.Event()
    thread = threading.Thread(target=asyncio.run, name="kopf", args=(kopf.operator(
        registry=registry, settings=operator_settings(), standalone=True, clusterwide=False,
        namespaces=[NS], stop_flag=stop),))
    thread.start()
    try:
        yield Harness(kmock, router)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive()


# ---- tests ----------------------------------------------------------------------------------
async def test_create_builds_owned_objects(harness: Harness) -> None:
    await harness.create(replicas=3)
    sts = await eventually(harness.statefulset)
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["DP_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{res.POD_INDEX_LABEL}']"
    assert env["DP_SIZE"]["valueFrom"]["configMapKeyRef"] == {"name": f"{NAME}-engine", "key": "DP_SIZE"}
    assert container["readinessProbe"]["grpc"]["service"] == "modeserve.v1.Engine"
    assert container["image"] == "modeserve:test"  # the operator's default image
    objs = {key: await eventually(functools.partial(read, harness.kmock, *key)) for key in OWNED}
    for obj in objs.values():
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": "modeserve.io/v1alpha1", "kind": "EngineSet", "name": NAME, "uid": "uid-llama",
            "controller": True, "blockOwnerDeletion": True}]
    assert objs["v1/services", f"{NAME}-engine"]["spec"]["clusterIP"] == "None"
    assert objs["v1/services", NAME]["spec"]["ports"][0]["port"] == 50051
    router_pod = objs["apps/v1/deployments", f"{NAME}-router"]["spec"]["template"]["spec"]
    assert router_pod["containers"][0]["args"][:5] == ["router", "--engineset", NAME, "--namespace", NS]
    assert router_pod["serviceAccountName"] == "modeserve-router"  # may watch EngineSets (the chart's Role)

    def with_status() -> Any:  # the status is patched after the owned objects are created
        es = harness.engineset()
        return es if "status" in es else None

    es = await eventually(with_status)
    assert es["metadata"]["finalizers"] == ["modeserve.io/engineset-cleanup"]
    assert es["status"]["selector"] == res.engine_selector_string(NAME) and es["status"]["observedGeneration"] == 1


async def test_status_gets_the_rank_table_once_pods_exist(harness: Harness) -> None:
    await harness.create(replicas=2)
    await eventually(lambda: harness.ranks())
    assert [r["state"] for r in harness.ranks()] == ["Joining", "Joining"]  # no pods yet
    await harness.add_pod(0)
    await harness.add_pod(1)
    await harness.add_pod(0, name="other")  # another EngineSet's pod: kmock ignores the label selector

    def table() -> bool:
        return [(r["rank"], r.get("pod"), r["state"]) for r in harness.ranks()] == [
            (0, f"{NAME}-engine-0", "Ready"), (1, f"{NAME}-engine-1", "Ready")]
    await eventually(table)
    status = harness.engineset()["status"]
    assert status["readyReplicas"] == 2 and status["replicas"] == 2
    assert status["ranks"][1]["address"] == f"{NAME}-engine-1.{NAME}-engine.{NS}.svc:50061"
    assert harness.condition("Available")["status"] == "True"
    assert harness.condition("Progressing")["status"] == "False"
    last = harness.router.set_calls()[-1]
    assert last.ranks == [RouterRank(0, res.rank_address(NAME, NS, 0), False),
                          RouterRank(1, res.rank_address(NAME, NS, 1), False)]


async def test_scale_subresource_scales_up_at_once(harness: Harness) -> None:
    await harness.create(replicas=1)
    await eventually(lambda: harness.replicas() == 1)
    template = harness.statefulset()["spec"]["template"]
    await harness.patch(f"{ES_PATH}/{NAME}/scale", {"spec": {"replicas": 3}})  # as `kubectl scale` does
    sts = await eventually(lambda: harness.replicas() == 3 and harness.statefulset())
    await eventually(lambda: harness.kmock.objects["v1/configmaps", NS, f"{NAME}-engine"]["data"]["DP_SIZE"] == "3")
    assert sts["spec"]["template"] == template  # unchanged: the ranks that stay are not restarted


async def test_fields_removed_from_the_spec_leave_the_statefulset(harness: Harness) -> None:
    """A node selector, tolerations and a GPU limit taken out of the EngineSet are taken out of the
    engine pods' template too (a merge patch keeps what it does not null); the rest stays."""
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    await harness.create(replicas=1, nodeSelector={"gpu": "h200", "zone": "a"}, tolerations=[toleration],
                         resources={"limits": {"nvidia.com/gpu": "1"}})

    def pod_spec() -> dict[str, Any]:
        return harness.statefulset()["spec"]["template"]["spec"]  # type: ignore[index]
    await eventually(lambda: pod_spec()["nodeSelector"] == {"gpu": "h200", "zone": "a"})
    assert pod_spec()["tolerations"] == [toleration]
    assert pod_spec()["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    await harness.patch(f"{ES_PATH}/{NAME}", {"spec": {"nodeSelector": {"zone": None}, "tolerations": None,
                                                       "resources": None}})
    await eventually(lambda: pod_spec()["nodeSelector"] == {"gpu": "h200"})
    await eventually(lambda: "tolerations" not in pod_spec() and pod_spec()["containers"][0]["resources"] == {})
    assert pod_spec()["containers"][0]["image"] == "modeserve:test" and harness.replicas() == 1
    await harness.patch(f"{ES_PATH}/{NAME}", {"spec": {"nodeSelector": None}})
    await eventually(lambda: "nodeSelector" not in pod_spec())


async def test_scale_down_drains_before_the_statefulset_shrinks(harness: Harness) -> None:
    await harness.create(replicas=3)
    for rank in range(3):
        await harness.add_pod(rank)
    await eventually(lambda: [r["state"] for r in harness.ranks()] == ["Ready"] * 3)
    await harness.patch(f"{ES_PATH}/{NAME}/scale", {"spec": {"replicas": 2}})

    def draining_call() -> RouterCall:
        drain_2 = RouterRank(2, res.rank_address(NAME, NS, 2), True)
        return next(c for c in harness.router.set_calls() if drain_2 in c.ranks)
    first = await eventually(draining_call)
    assert first.statefulset_replicas == 3  # told to drain while rank 2's pod still exists
    await eventually(lambda: [r["state"] for r in harness.ranks()] == ["Ready", "Ready", "Draining"])
    assert harness.condition("Progressing")["reason"] == "Draining"
    assert await eventually(lambda: ("Draining", "ranks [2] draining before the scale-down to 2") in harness.events())
    await asyncio.sleep(1.0)  # five reconciles while the router still reports DRAINING
    assert harness.replicas() == 3

    harness.router.drained.add(2)
    await eventually(lambda: harness.replicas() == 2)
    # the StatefulSet PATCH to 2 came after the router was told to drain rank 2, and after the
    # router's table no longer held rank 2
    shrink = next(r for r in harness.kmock if r.method == "PATCH" and r.resource == STS
                  and (r.data or {}).get("spec", {}).get("replicas") == 2)
    assert first.requests_before <= shrink.id
    removal = next(c for c in harness.router.set_calls() if c.requests_before > first.requests_before
                   and all(r.rank != 2 for r in c.ranks))
    assert removal.requests_before <= shrink.id and removal.statefulset_replicas == 3


async def test_scale_down_goes_ahead_after_the_drain_timeout(harness: Harness) -> None:
    await harness.create(replicas=2, drainTimeoutSeconds=1)
    for rank in range(2):
        await harness.add_pod(rank)
    await eventually(lambda: [r["state"] for r in harness.ranks()] == ["Ready"] * 2)
    await harness.patch(f"{ES_PATH}/{NAME}", {"spec": {"replicas": 1}})
    await eventually(lambda: harness.router.table.get(1, ("", ""))[1] == "DRAINING")
    started = time.monotonic()
    await eventually(lambda: harness.replicas() == 1, timeout=5)  # never reported DRAINED
    assert time.monotonic() - started > 0.5
    assert 1 not in harness.router.table


async def test_failed_pod_is_not_ready_and_leaves_the_router(harness: Harness) -> None:
    await harness.create(replicas=2)
    for rank in range(2):
        await harness.add_pod(rank)
    await eventually(lambda: set(harness.router.table) == {0, 1})
    await harness.patch(f"{POD_PATH}/{NAME}-engine-1/status", {"status": {"phase": "Failed"}})
    await eventually(lambda: [r["state"] for r in harness.ranks()] == ["Ready", "NotReady"])
    await eventually(lambda: set(harness.router.table) == {0})
    degraded = harness.condition("Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "RanksNotReady" and "[1]" in degraded["message"]
    assert harness.engineset()["status"]["readyReplicas"] == 1


async def test_invalid_spec_is_degraded_and_deploys_nothing(harness: Harness) -> None:
    await harness.create(engine={"page_sise": "16"})
    degraded = await eventually(lambda: harness.condition("Degraded").get("status") == "True"
                                and harness.condition("Degraded"))
    assert degraded["reason"] == "InvalidSpec" and "page_sise" in degraded["message"]
    await eventually(lambda: any("page_sise" in message for _, message in harness.events()))  # kopf's Event
    await asyncio.sleep(0.5)  # timers ran; still nothing
    assert harness.statefulset() is None and not harness.router.calls


async def test_router_unreachable_is_reported_and_retried(harness: Harness) -> None:
    harness.router.reachable = False
    await harness.create(replicas=1)
    await eventually(lambda: harness.condition("Degraded").get("reason") == "RouterUnreachable")
    assert harness.replicas() == 1  # everything that needs no router is done
    harness.router.reachable = True
    await eventually(lambda: harness.condition("Degraded").get("status") == "False")


async def test_delete_removes_the_owned_objects(harness: Harness) -> None:
    await harness.create(replicas=1)
    for key in OWNED:
        await eventually(functools.partial(read, harness.kmock, *key))
    resp = await harness.kmock.delete(f"{ES_PATH}/{NAME}")
    assert resp.status < 300
    for key in [*OWNED, (ES, NAME)]:
        await eventually(lambda key=key: read(harness.kmock, *key) is None)  # type: ignore[misc]
