"""What the EngineSet-watch tests share: kmock's Kubernetes emulator with the endings a real API
server gives a watch (``WatchEmulator``), the ``cluster`` fixture (an EngineSet resource on it, and
``Cluster`` to create, patch and publish EngineSets; import the fixture into the test module), the
status entries the operator publishes (``status_entry``) and the router's ``RankSpec`` for a rank
(``spec``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, cast

import attrs
import kmock
import pytest_asyncio
from kubernetes import client as k8s

from modeserve.operator.resources import rank_address
from modeserve.service.router.engineset_watch import EngineSetWatch
from modeserve.service.router.rank_table import RankSpec
from tests.operator.kmock_harness import VersionedEmulator

NS, NAME = "serving", "llama"
ES = "modeserve.io/v1alpha1/enginesets"
ES_PATH = f"/apis/modeserve.io/v1alpha1/namespaces/{NS}/enginesets"
MERGE = {"Content-Type": "application/merge-patch+json"}


@attrs.define(kw_only=True)
class WatchEmulator(VersionedEmulator):
    """Plus the endings a real API server gives a watch: ``end_watches()`` ends the open streams (as
    its timeout does); ``expire_watches(n)`` answers the next ``n`` watches with a 410 ERROR event (their
    resourceVersion is too old); ``fail_lists(n)`` answers the next ``n`` lists with a 500."""
    _ending: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _expire: int = attrs.field(default=0, init=False)
    _fail: int = attrs.field(default=0, init=False)

    def end_watches(self) -> None:
        self._ending.set()
        self._ending = asyncio.Event()

    def expire_watches(self, n: int = 1) -> None:
        self._expire = n

    def fail_lists(self, n: int) -> None:
        self._fail = n

    async def _handle(self, request: kmock.Request) -> Any:
        if request.action == kmock.action.LIST and self._fail > 0:
            self._fail -= 1
            raise kmock.KubernetesError(status=500, reason="InternalError", message="etcd is down")
        return await super()._handle(request)

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """kmock's watch (the objects as ADDED, then every change), with its bus position taken with the
        snapshot, under the lock writes hold: no change falls between the two."""
        yield b""
        if self._expire > 0:
            self._expire -= 1
            yield {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                               "reason": "Expired", "code": 410, "message": "too old resource version"}}
            return
        assert request.resource is not None
        bus = self._buses[request.resource]
        async with self._lock:
            mark = await bus.mark()
            snapshot = [obj.raw for (resource, ns, name), obj in self.objects.items()
                        if resource == request.resource and request.namespace in (None, ns)
                        and request.name in (None, name) and not obj.deleted]
        ended = asyncio.ensure_future(self._ending.wait())
        events = cast(AsyncGenerator[Any, None], bus.stream(since=mark))
        step: asyncio.Future[Any] | None = None
        try:
            for raw in snapshot:
                yield {"type": "ADDED", "object": raw}
            while True:
                step = asyncio.ensure_future(events.__anext__())
                await asyncio.wait({step, ended}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    return  # ended
                event = step.result()
                meta = event.get("object", {}).get("metadata", {})
                if request.namespace in (None, meta.get("namespace")) and request.name in (None, meta.get("name")):
                    yield event
        finally:  # ended, or the client went away
            ended.cancel()
            if step is not None and not step.done():
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await step
            await events.aclose()
            await bus.unmark(mark)


def status_entry(rank: int, state: str, pod_ready: bool = True, address: str | None = None) -> dict[str, Any]:
    return {"rank": rank, "address": address or rank_address(NAME, NS, rank), "state": state, "podReady": pod_ready,
            "pod": f"{NAME}-engine-{rank}"}


@attrs.define
class Cluster:
    kmock: Any
    url: str

    async def create(self, ranks: list[dict[str, Any]] | None, name: str = NAME) -> None:
        body: dict[str, Any] = {"apiVersion": "modeserve.io/v1alpha1", "kind": "EngineSet",
                                "metadata": {"name": name, "namespace": NS},
                                "spec": {"model": {"path": "/models/m.gguf"}, "replicas": 2}}
        if ranks is not None:
            body["status"] = {"ranks": ranks}
        resp = await self.kmock.post(ES_PATH, json=body)
        assert resp.status < 300, await resp.text()

    async def patch(self, body: dict[str, Any], name: str = NAME, subresource: str = "") -> None:
        path = f"{ES_PATH}/{name}" + (f"/{subresource}" if subresource else "")
        resp = await self.kmock.patch(path, data=json.dumps(body), headers=MERGE)
        assert resp.status < 300, await resp.text()

    async def publish(self, ranks: list[dict[str, Any]], name: str = NAME) -> None:
        """What the operator's status write does."""
        await self.patch({"status": {"ranks": ranks}}, name, "status")

    def requests(self, action: Any) -> list[Any]:
        return [r for r in self.kmock if r.action == action and r.resource == self.kmock.resource(ES)]

    def watch(self, **kw: Any) -> EngineSetWatch:
        return EngineSetWatch(k8s.ApiClient(k8s.Configuration(host=self.url)), NS, NAME, min_backoff=0.05, **kw)


@pytest_asyncio.fixture
async def cluster(kmock: Any) -> Cluster:
    kmock.resources[ES] = kmock.ResourceInfo(kind="EngineSet", namespaced=True, subresources={"status"},
                                             verbs={"get", "list", "watch", "create", "patch", "delete"})
    return Cluster(kmock, str(kmock.url).rstrip("/"))


async def eventually(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {getattr(check, '__name__', check)}")
        await asyncio.sleep(0.02)
    return result


def spec(rank: int, draining: bool = False) -> RankSpec:
    return RankSpec(rank, rank_address(NAME, NS, rank), draining)
