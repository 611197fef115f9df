"""The router's watch of its EngineSet's published rank table (``service.engineset_watch``), against
kmock's Kubernetes emulator (real HTTP from the ``kubernetes`` client's list and watch): each new
table is applied once, other objects and unrelated changes are not; a watch the server ends is
resumed from the last version; a 410 lists again; failed lists are retried; the router's command
line watches with the environment's credentials. The emulator and the ``cluster`` fixture are in
``tests.service.engineset_cluster``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import kmock
import pytest

from modeserve.service.cli import build_parser
from modeserve.service.router.engineset_watch import EngineSetWatch
from modeserve.service.router.rank_table import RankSpec
from modeserve.service.cli.router import engineset_watch
from tests.service.engineset_cluster import (ES, NAME, NS, Cluster, WatchEmulator, cluster,  # noqa: F401  (a fixture)
                                             eventually, spec, status_entry)

pytestmark = pytest.mark.kmock(cls=WatchEmulator)


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
