"""The operator end to end against kmock's Kubernetes emulator, for the objects an EngineSet owns:
creating one builds its StatefulSet, router Deployment, Services and ConfigMap (owned, with the
operator's defaults) and then its status; fields taken out of the spec leave the engine pods'
template; an invalid spec is reported Degraded and deploys nothing; deleting the EngineSet removes
what it owns. The emulator and the fake router are in ``tests.operator.kmock_harness``, the
``harness`` fixture in this folder's ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

from modeserve.operator import resources as res
from tests.operator.kmock_harness import ES, ES_PATH, NAME, NS, OWNED, Harness, VersionedEmulator, eventually, read

pytestmark = [pytest.mark.asyncio, pytest.mark.kmock(cls=VersionedEmulator)]


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
    policy = objs["networking.k8s.io/v1/networkpolicies", f"{NAME}-engine"]["spec"]
    assert policy["podSelector"]["matchLabels"] == res.selector(NAME, "engine")
    router_pod = objs["apps/v1/deployments", f"{NAME}-router"]["spec"]["template"]["spec"]
    assert router_pod["containers"][0]["args"][:5] == ["router", "--engineset", NAME, "--namespace", NS]
    assert router_pod["serviceAccountName"] == "modeserve-router"  # may watch EngineSets (the chart's Role)

    def with_status() -> Any:  # the status is patched after the owned objects are created
        es = harness.engineset()
        return es if "status" in es else None

    es = await eventually(with_status)
    assert es["metadata"]["finalizers"] == ["modeserve.io/engineset-cleanup"]
    assert es["status"]["selector"] == res.engine_selector_string(NAME) and es["status"]["observedGeneration"] == 1


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


async def test_invalid_spec_is_degraded_and_deploys_nothing(harness: Harness) -> None:
    await harness.create(engine={"page_sise": "16"})
    degraded = await eventually(lambda: harness.condition("Degraded").get("status") == "True"
                                and harness.condition("Degraded"))
    assert degraded["reason"] == "InvalidSpec" and "page_sise" in degraded["message"]
    await eventually(lambda: any("page_sise" in message for _, message in harness.events()))  # kopf's Event
    await asyncio.sleep(0.5)  # timers ran; still nothing
    assert harness.statefulset() is None and not harness.router.calls


async def test_tensor_parallel_gpus_that_do_not_match_are_degraded(harness: Harness) -> None:
    await harness.create(tensorParallelSize=2, engine={"device": "cuda"}, resources={"limits": {"nvidia.com/gpu": "1"}})
    degraded = await eventually(lambda: harness.condition("Degraded").get("status") == "True"
                                and harness.condition("Degraded"))
    assert degraded["reason"] == "InvalidSpec" and "must equal spec.tensorParallelSize 2" in degraded["message"]
    assert harness.statefulset() is None
    await harness.patch(f"{ES_PATH}/{NAME}", {"spec": {"resources": {"limits": {"nvidia.com/gpu": "2"}}}})
    await eventually(lambda: harness.statefulset() is not None)
    (c,) = harness.statefulset()["spec"]["template"]["spec"]["containers"]  # type: ignore[index]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "2"} and "--tensor-parallel-size" in c["args"]


async def test_delete_removes_the_owned_objects(harness: Harness) -> None:
    await harness.create(replicas=1)
    for key in OWNED:
        await eventually(functools.partial(read, harness.kmock, *key))
    resp = await harness.kmock.delete(f"{ES_PATH}/{NAME}")
    assert resp.status < 300
    for key in [*OWNED, (ES, NAME)]:
        await eventually(lambda key=key: read(harness.kmock, *key) is None)  # type: ignore[misc]
