"""The router follows its EngineSet's published rank table (``service.engineset_watch``).

Against kmock's Kubernetes emulator (real HTTP from the ``kubernetes`` client's list and watch): each
new table is applied once, other objects and unrelated changes are not; a watch the server ends is
resumed from the last version; a 410 lists again; failed lists are retried. End to end: a router
started without ``--engines`` over two in-process engine servers on loopback takes its ranks from the
status, stops sending to a rank marked Draining, drops a rank left out, and keeps the same table when
the operator's SetRanks pushes it too. Pure: the table read back from the operator's status is the
one the operator pushes with SetRanks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import attrs
import grpc
import kmock
import pytest
import pytest_asyncio
from kubernetes import client as k8s

from modeserve.engine.config import EngineConfig, SchedulerConfig
from modeserve.engine.models.loader import open_checkpoint
from modeserve.engine.runner.model_runner import ModelRunner
from modeserve.operator.ranks import RouterRank, rank_views, router_ranks
from modeserve.operator.resources import rank_address
from modeserve.proto.v1 import admin_pb2, admin_pb2_grpc
from modeserve.service.cli import build_parser
from modeserve.service.rpc.client import GenerateClient
from modeserve.service.rpc.engine_server import create_engine_server
from modeserve.service.router.engineset_watch import EngineSetWatch, pod_namespace, ranks_from_status
from modeserve.service.rpc.grpc_server import GrpcServer
from modeserve.service.router.rank_table import RankSpec, RankState
from modeserve.service.cli.router import engineset_watch
from modeserve.service.router.remote import RemoteRouterConfig, start_remote_router
from tests.engine.tiny_models import COMMON, mixed_prompts
from tests.operator.test_operator_kmock import VersionedEmulator
from tests.service.test_serve import generate_all

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


pytestmark = pytest.mark.kmock(cls=WatchEmulator)


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


class Applied:
    """The tables the watch applied, in order (a stand-in for ``RankTable.set_ranks``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tables: list[list[RankSpec]] = []

    def __call__(self, table: list[RankSpec]) -> None:
        with self.lock:
            self.tables.append(table)

    def get(self) -> list[list[RankSpec]]:
        with self.lock:
            return list(self.tables)


@contextlib.asynccontextmanager
async def following(cluster: Cluster) -> AsyncIterator[tuple[EngineSetWatch, Applied]]:
    watch, applied = cluster.watch(), Applied()
    watch.start().follow(applied)
    try:
        yield watch, applied
    finally:
        await asyncio.to_thread(watch.stop)
        assert not watch.alive  # stop() ended the thread, even in the middle of a watch


def spec(rank: int, draining: bool = False) -> RankSpec:
    return RankSpec(rank, rank_address(NAME, NS, rank), draining)


# ---- the watch against kmock --------------------------------------------------------------------
@pytest.mark.asyncio
async def test_each_new_table_is_applied_once(cluster: Cluster) -> None:
    await cluster.create([status_entry(0, "Ready"), status_entry(1, "Joining", pod_ready=False)])
    await cluster.create([status_entry(0, "Ready", address="other-engine-0:50061")], name="other")
    async with following(cluster) as (_, applied):
        await eventually(lambda: applied.get() == [[spec(0)]])
        await cluster.publish([status_entry(0, "Ready"), status_entry(1, "Joining")])  # rank 1's pod is Ready
        await eventually(lambda: len(applied.get()) == 2)
        # not applied again: kopf's annotations, a spec edit, another EngineSet's status
        await cluster.patch({"metadata": {"annotations": {"modeserve.io/last-handled-configuration": "{}"}}})
        await cluster.patch({"spec": {"replicas": 3}})
        await cluster.publish([status_entry(0, "Draining", address="other-engine-0:50061")], name="other")
        await cluster.publish([status_entry(0, "Ready"), status_entry(1, "Draining"),
                               status_entry(2, "Joining", pod_ready=False)])
        await eventually(lambda: len(applied.get()) == 3)
        await asyncio.sleep(0.1)
    assert applied.get() == [[spec(0)], [spec(0), spec(1)], [spec(0), spec(1, draining=True)]]
    assert len(cluster.requests(kmock.action.LIST)) == 1 and len(cluster.requests(kmock.action.WATCH)) == 1


@pytest.mark.asyncio
async def test_ended_watch_resumes_and_expired_one_lists_again(cluster: Cluster) -> None:
    await cluster.create([status_entry(0, "Ready")])
    async with following(cluster) as (_, applied):
        await eventually(lambda: applied.get() == [[spec(0)]])
        await cluster.publish([status_entry(0, "Ready"), status_entry(1, "Ready")])
        await eventually(lambda: len(applied.get()) == 2)
        version = cluster.kmock.objects[cluster.kmock.resource(ES), NS, NAME].raw["metadata"]["resourceVersion"]

        cluster.kmock.end_watches()  # the server's timeout: watch again from the last version seen
        watches = await eventually(lambda: len(cluster.requests(kmock.action.WATCH)) == 2
                                   and cluster.requests(kmock.action.WATCH))
        assert watches[1].params["resourceVersion"] == version
        assert len(cluster.requests(kmock.action.LIST)) == 1
        await cluster.publish([status_entry(1, "Ready")])
        await eventually(lambda: applied.get()[-1:] == [[spec(1)]])

        cluster.kmock.expire_watches(1)  # 410 Gone on the next watch: list again, then watch
        cluster.kmock.end_watches()
        await eventually(lambda: len(cluster.requests(kmock.action.LIST)) == 2
                         and len(cluster.requests(kmock.action.WATCH)) == 4)
        await cluster.publish([status_entry(0, "Ready")])
        await eventually(lambda: applied.get()[-1:] == [[spec(0)]])
    assert applied.get() == [[spec(0)], [spec(0), spec(1)], [spec(1)], [spec(0)]]


@pytest.mark.asyncio
async def test_failed_lists_are_retried_and_the_first_table_waited_for(cluster: Cluster) -> None:
    cluster.kmock.fail_lists(3)
    watch = cluster.watch().start()
    try:
        with pytest.raises(TimeoutError):
            await asyncio.to_thread(watch.wait_ranks, 0.3)  # nothing published: no EngineSet yet
        await cluster.create([status_entry(0, "Joining", pod_ready=False)])  # no rank to connect to yet
        with pytest.raises(TimeoutError):
            await asyncio.to_thread(watch.wait_ranks, 0.3)
        await cluster.publish([status_entry(0, "Joining")])
        assert await asyncio.to_thread(watch.wait_ranks, 5) == [spec(0)]
        assert len(cluster.requests(kmock.action.LIST)) == 4  # three failures, then backed-off retries
    finally:
        await asyncio.to_thread(watch.stop)


# ---- the table read back from the status is the one the operator pushes -------------------------
def test_status_states_map_to_router_ranks() -> None:
    assert ranks_from_status(None) is None and ranks_from_status({"conditions": []}) is None
    assert ranks_from_status({"ranks": []}) == []
    status = {"ranks": [status_entry(4, "Drained"), status_entry(0, "Ready"), status_entry(1, "Joining"),
                        status_entry(2, "Joining", pod_ready=False), status_entry(3, "Draining"),
                        status_entry(5, "NotReady"), {"rank": 6, "state": "Joining"},
                        {"rank": 7, "address": "a:1", "state": "Ready"}]}
    assert ranks_from_status(status) == [spec(0), spec(1), spec(3, draining=True), RankSpec(7, "a:1")]


def router_after(pushed: list[RouterRank], before: dict[int, str]) -> dict[int, str]:
    """The router's states after SetRanks(``pushed``), as ``RankTable.set_ranks`` leaves them."""
    after = {}
    for r in pushed:
        state = before.get(r.rank)
        if state in (None, "GONE"):
            state = "JOINING"
        elif r.draining and state == "READY":
            state = "DRAINING"
        elif not r.draining and state == "DRAINING":
            state = "READY"
        after[r.rank] = state
    return after


def pod(rank: int, ready: bool = True, started: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": f"{NAME}-engine-{rank}", "namespace": NS,
                         "labels": {"apps.kubernetes.io/pod-index": str(rank)}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}],
                       "containerStatuses": [{"name": "engine", "started": started}]}}


@pytest.mark.parametrize("pods, replicas, draining, before, sts_replicas, left_out", [
    # scale-up: rank 1 joins (pod Ready, new to the router), rank 2's pod is still loading
    ([pod(0), pod(1), pod(2, ready=False, started=False)], 3, set(), {0: "READY"}, 3, set()),
    # scale-down: rank 2 drains before the StatefulSet shrinks
    ([pod(0), pod(1), pod(2)], 2, {2}, {0: "READY", 1: "READY", 2: "READY"}, 3, set()),
    # the drain timed out: the StatefulSet shrinks, rank 2 is left out of both
    ([pod(0), pod(1), pod(2)], 2, {2}, {0: "READY", 1: "READY", 2: "DRAINING"}, 2, set()),
    # rank 2 drained: the push keeps it (draining), the status says Drained; removed one reconcile sooner
    ([pod(0), pod(1), pod(2)], 2, {2}, {0: "READY", 1: "READY", 2: "DRAINED"}, 3, {2}),
    # a failed pod leaves both
    ([pod(0), pod(1, ready=False)], 2, set(), {0: "READY", 1: "READY"}, 2, set()),
])
def test_table_from_status_is_the_pushed_table(pods: list[dict[str, Any]], replicas: int, draining: set[int],
                                               before: dict[int, str], sts_replicas: int, left_out: set[int]) -> None:
    """The reconcile's order: push ``router_ranks``, then publish the status from the router's answer."""
    pushed = router_ranks(rank_views(pods, replicas, draining, before, name=NAME, namespace=NS), sts_replicas)
    after = router_after(pushed, before)
    status = {"ranks": [v.status() for v in rank_views(pods, replicas, draining, after, name=NAME, namespace=NS)]}
    assert ranks_from_status(status) == [RankSpec(r.rank, r.address, r.draining) for r in pushed
                                         if r.rank not in left_out]


def test_a_failed_rank_is_offered_again_from_the_status_one_reconcile_sooner() -> None:
    """The push leaves a rank the router reports GONE out (to offer it again next reconcile); the
    status then shows it Joining with a Ready pod, so the watch offers it at once."""
    pods, before = [pod(0), pod(1)], {0: "READY", 1: "GONE"}
    pushed = router_ranks(rank_views(pods, 2, set(), before, name=NAME, namespace=NS), 2)
    assert [r.rank for r in pushed] == [0]
    status = {"ranks": [v.status() for v in rank_views(pods, 2, set(), router_after(pushed, before),
                                                       name=NAME, namespace=NS)]}
    assert ranks_from_status(status) == [spec(0), spec(1)]


def test_namespace_from_env_else_service_account_file(tmp_path: Path) -> None:
    sa = tmp_path / "namespace"
    assert pod_namespace({"POD_NAMESPACE": "a"}, sa) == "a"
    assert pod_namespace({}, sa) is None
    sa.write_text("b\n")
    assert pod_namespace({}, sa) == "b"


@pytest.mark.asyncio
async def test_router_command_line_watches_with_the_environment_credentials(
        cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(json.dumps({  # kubeconfig is YAML, and JSON is YAML
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": cluster.url}}],
        "users": [{"name": "me", "user": {}}], "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "me"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: the kubeconfig
    monkeypatch.setenv("POD_NAMESPACE", NS)
    args = build_parser().parse_args(["router", "--engineset", NAME])
    watch = engineset_watch(args.engineset, args.namespace)
    assert (watch.namespace, watch.name, args.engines) == (NS, NAME, None)
    await cluster.create([status_entry(0, "Ready")])
    try:
        assert await asyncio.to_thread(watch.start().wait_ranks, 5) == [spec(0)]
    finally:
        await asyncio.to_thread(watch.stop)
    for wrong in (["router"], ["router", "--engines", "a:1", "--engineset", NAME]):  # one source of ranks
        with pytest.raises(SystemExit):
            build_parser().parse_args(wrong)
    monkeypatch.delenv("POD_NAMESPACE")
    monkeypatch.setattr("modeserve.service.router.engineset_watch.NAMESPACE_FILE", tmp_path / "absent")  # not in a pod
    with pytest.raises(ValueError, match="--namespace"):
        engineset_watch(NAME, None)


# ---- end to end: a router over in-process engines, ranks from the EngineSet ---------------------
@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[GrpcServer]]:
    config = EngineConfig.from_kwargs(model=str(tiny_model), page_size=4, kv_cache_tokens=1024)
    servers = [create_engine_server(ModelRunner(config.runner, open_checkpoint(tiny_model)), "127.0.0.1:0",
                                    model_path=str(tiny_model), dp_rank=r) for r in range(2)]
    yield servers
    for srv in servers:
        srv.shutdown(0).wait()


def extends(app: Any) -> dict[int, int]:
    """Requests each rank has prefilled, by rank (short prompts, no MIXED: one EXTEND each)."""
    return {r.rank: r.loop.scheduler.stats.get_stats()["requests_by_mode"].get("EXTEND", 0)
            for r in app.table.ranks() if r.loop is not None}


@pytest.mark.asyncio
async def test_router_without_engines_follows_the_engineset(cluster: Cluster, engines: list[GrpcServer]) -> None:
    addresses = [f"127.0.0.1:{srv.port}" for srv in engines]
    await cluster.create([status_entry(r, "Ready", address=a) for r, a in enumerate(addresses)])
    app = await asyncio.to_thread(start_remote_router, "127.0.0.1:0", [], None,
                                  RemoteRouterConfig(SchedulerConfig(), wait=10, dispatch="round-robin",
                                                     health_interval=0.1), watch=cluster.watch())
    client = GenerateClient(f"127.0.0.1:{app.port}")

    async def generate(n: int, seed: int) -> None:
        prompts = mixed_prompts(n, COMMON["vocab_size"], seed=seed, max_len=20)
        outs = await asyncio.to_thread(generate_all, client, prompts, 4)
        assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in outs)

    try:
        # both ranks from the status, READY once their engines serve; both take requests
        assert [(s.rank, s.address, s.state) for s in app.table.status()] == [
            (0, addresses[0], RankState.READY), (1, addresses[1], RankState.READY)]
        await generate(8, seed=31)
        assert all(n > 0 for n in extends(app).values()) and len(extends(app)) == 2
        loops = app.loops

        # the operator's SetRanks with the same table changes nothing (same streams, same states)
        stub = admin_pb2_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{app.port}"))
        reply = stub.SetRanks(admin_pb2.SetRanksRequest(ranks=[admin_pb2.RankSpec(rank=r, address=a)
                                                               for r, a in enumerate(addresses)]))
        assert [r.state for r in reply.ranks] == [admin_pb2.RANK_STATE_READY] * 2
        assert app.loops == loops and all(lp.alive for lp in loops)

        # rank 1 draining: no new requests go there
        await cluster.publish([status_entry(0, "Ready", address=addresses[0]),
                               status_entry(1, "Draining", address=addresses[1])])
        await eventually(lambda: app.table.status()[1].state in (RankState.DRAINING, RankState.DRAINED))
        before = extends(app)
        await generate(6, seed=32)
        after = extends(app)
        assert after[1] == before[1] and after[0] == before[0] + 6

        # the watch expires (410) and is listed again; then rank 1 leaves the status and the router
        lists = len(cluster.requests(kmock.action.LIST))
        cluster.kmock.expire_watches(1)
        cluster.kmock.end_watches()
        await eventually(lambda: len(cluster.requests(kmock.action.LIST)) == lists + 1)
        await cluster.publish([status_entry(0, "Ready", address=addresses[0])])
        await eventually(lambda: [r.rank for r in app.table.ranks()] == [0])
        await generate(2, seed=33)
        assert client.model_info().num_ranks == 1
    finally:
        client.close()
        await asyncio.to_thread(app.stop, 1)
