"""The operator end to end against kmock's Kubernetes emulator, for the rank table and scaling: the
status gets the table once the engine pods exist and the router is told it; the ``/scale``
subresource scales up at once; a scale-down drains the leaving ranks in the router before the
StatefulSet shrinks, or goes ahead after the drain timeout; a failed pod is NotReady and leaves the
router; an unreachable router is reported and retried. The emulator and the fake router are in
``tests.operator.kmock_harness``, the ``harness`` fixture in this folder's ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from modeserve.operator import resources as res
from modeserve.operator.ranks import RouterRank
from tests.operator.kmock_harness import (ES_PATH, NAME, NS, POD_PATH, STS, Harness, RouterCall, VersionedEmulator,
                                          eventually)

pytestmark = [pytest.mark.asyncio, pytest.mark.kmock(cls=VersionedEmulator)]


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


async def test_router_unreachable_is_reported_and_retried(harness: Harness) -> None:
    harness.router.reachable = False
    await harness.create(replicas=1)
    await eventually(lambda: harness.condition("Degraded").get("reason") == "RouterUnreachable")
    assert harness.replicas() == 1  # everything that needs no router is done
    harness.router.reachable = True
    await eventually(lambda: harness.condition("Degraded").get("status") == "False")
