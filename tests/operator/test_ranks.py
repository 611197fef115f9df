"""The operator's decisions as pure functions: rank states from pods and the router, what the router
is told, how far a scale-down may go (drain first, shrink when drained or timed out), conditions."""

from __future__ import annotations

from typing import Any

import pytest

from modeserve.operator.conditions import conditions, invalid_spec_conditions, merge_conditions
from modeserve.operator.ranks import (RouterRank, ScalePlan, plan_scale, pod_rank, rank_table, rank_views,
                                     router_ranks)
from modeserve.operator.resources import rank_address

NS = "serving"


def pod(rank: int, phase: str = "Running", ready: bool = True, started: bool = True, index_label: bool = True,
        terminating: bool = False) -> dict[str, Any]:
    labels = {"modeserve.io/engineset": "llama", "app.kubernetes.io/component": "engine"}
    if index_label:
        labels["apps.kubernetes.io/pod-index"] = str(rank)
    meta: dict[str, Any] = {"name": f"llama-engine-{rank}", "namespace": NS, "labels": labels}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {
        "phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": "engine", "started": started, "ready": ready}]}}


def states(table: list[dict[str, Any]]) -> dict[int, str]:
    return {r["rank"]: r["state"] for r in table}


# ---- rank table ---------------------------------------------------------------------------------
def test_rank_from_pod_index_label_else_name_suffix() -> None:
    assert pod_rank(pod(3)) == 3
    assert pod_rank(pod(7, index_label=False)) == 7
    assert pod_rank({"metadata": {"name": "no-ordinal"}}) is None


def test_rank_table_states_from_pods_and_router() -> None:
    pods = [pod(0), pod(1), pod(2, ready=False, started=False), pod(3, phase="Failed", ready=False),
            pod(4, ready=False), pod(5)]
    router = {0: "READY", 1: "JOINING", 5: "GONE"}
    table = rank_table(pods, 7, set(), router, name="llama", namespace=NS)
    assert states(table) == {0: "Ready", 1: "Joining", 2: "Joining", 3: "NotReady", 4: "NotReady", 5: "NotReady",
                             6: "Joining"}  # 2: still starting; 4: started, failing readiness; 6: no pod yet
    assert table[0] == {"rank": 0, "address": rank_address("llama", NS, 0), "state": "Ready", "pod": "llama-engine-0",
                        "podReady": True}
    assert "pod" not in table[6] and table[6]["address"] == rank_address("llama", NS, 6)
    # a Joining rank the router connects to (its pod is Ready) vs one still loading or without a pod
    assert [table[r]["podReady"] for r in (1, 2, 6)] == [True, False, False]


def test_rank_table_without_router_answer_trusts_pod_readiness() -> None:
    assert states(rank_table([pod(0), pod(1, ready=False)], 2, set(), None)) == {0: "Ready", 1: "NotReady"}


def test_leaving_ranks_are_draining_until_drained_gone_or_podless() -> None:
    pods = [pod(0), pod(1), pod(2), pod(3), pod(4, terminating=True, ready=False)]
    router = {0: "READY", 1: "DRAINING", 2: "DRAINED", 3: "GONE"}
    table = rank_table(pods, 1, {1, 2, 3}, router)
    assert states(table) == {0: "Ready", 1: "Draining", 2: "Drained", 3: "Drained", 4: "Drained"}
    # a leaving rank whose pod is gone is not listed
    assert states(rank_table([pod(0)], 2, {1}, router)) == {0: "Ready"}
    # unknown router: leaving ranks with a ready pod are still draining
    assert states(rank_table([pod(0), pod(1)], 1, {1}, None)) == {0: "Ready", 1: "Draining"}


def test_router_ranks_only_ready_pods_below_the_statefulset() -> None:
    pods = [pod(0), pod(1, phase="Failed", ready=False), pod(2), pod(3), pod(4)]
    router = {0: "READY", 1: "READY", 2: "GONE", 3: "READY", 4: "DRAINED"}
    views = rank_views(pods, 3, {3, 4}, router, name="llama", namespace=NS)
    assert router_ranks(views, statefulset_replicas=5) == [
        RouterRank(0, rank_address("llama", NS, 0), False),  # 1: pod failed; 2: GONE (offered again later)
        RouterRank(3, rank_address("llama", NS, 3), True), RouterRank(4, rank_address("llama", NS, 4), True)]
    assert [r.rank for r in router_ranks(views, statefulset_replicas=3)] == [0]  # 3, 4 about to be removed
    # a leaving rank the router never had is not added as draining
    assert router_ranks(rank_views([pod(0), pod(1)], 1, {1}, {0: "READY"}), 2) == [
        RouterRank(0, rank_address("llama", NS, 0), False)]


# ---- scaling ------------------------------------------------------------------------------------
def test_scale_up_and_first_deploy_are_immediate() -> None:
    assert plan_scale(None, 3, None, {}, now=0.0, drain_timeout=300) == ScalePlan(statefulset_replicas=3)
    plan = plan_scale(2, 5, {0: "READY", 1: "READY"}, {}, now=0.0, drain_timeout=300)
    assert plan.statefulset_replicas == 5 and not plan.draining and not plan.drain_started


def test_scale_down_drains_first_and_remembers_when() -> None:
    plan = plan_scale(4, 2, {0: "READY", 1: "READY", 2: "READY", 3: "READY"}, {}, now=100.0, drain_timeout=300)
    assert plan.statefulset_replicas == 4
    assert plan.draining == {2, 3} and plan.waiting == {2, 3} and plan.drain_started == {2: 100.0, 3: 100.0}
    assert plan.seconds_left == 300


def test_scale_down_shrinks_from_the_top_as_ranks_drain() -> None:
    started = {2: 100.0, 3: 100.0}
    # rank 2 drained but rank 3 still busy: a StatefulSet removes the highest ordinal first, so wait
    plan = plan_scale(4, 2, {2: "DRAINED", 3: "DRAINING"}, started, now=150.0, drain_timeout=300)
    assert plan.statefulset_replicas == 4 and plan.waiting == {3}
    plan = plan_scale(4, 2, {2: "DRAINING", 3: "DRAINED"}, started, now=150.0, drain_timeout=300)
    assert plan.statefulset_replicas == 3 and plan.waiting == {2} and not plan.timed_out
    # GONE or no longer listed: nothing can be sent there either
    plan = plan_scale(4, 2, {3: "GONE"}, started, now=150.0, drain_timeout=300)
    assert plan.statefulset_replicas == 2 and not plan.waiting


def test_scale_down_goes_ahead_after_the_timeout_but_not_blind_before() -> None:
    started = {1: 100.0}
    assert plan_scale(2, 1, {1: "DRAINING"}, started, now=399.0, drain_timeout=300).statefulset_replicas == 2
    plan = plan_scale(2, 1, {1: "DRAINING"}, started, now=400.0, drain_timeout=300)
    assert plan.statefulset_replicas == 1 and plan.timed_out == {1}
    # an unreachable router is not "drained": wait for the timeout
    assert plan_scale(2, 1, None, started, now=200.0, drain_timeout=300).statefulset_replicas == 2
    assert plan_scale(2, 1, None, started, now=400.0, drain_timeout=300).statefulset_replicas == 1


@pytest.mark.parametrize("desired", [3, 4])
def test_scale_back_up_cancels_the_drain(desired: int) -> None:
    plan = plan_scale(3, desired, {2: "DRAINING"}, {2: 100.0}, now=150.0, drain_timeout=300)
    assert plan.statefulset_replicas == desired and not plan.draining and not plan.drain_started


# ---- conditions ---------------------------------------------------------------------------------
def cond(conds: list[dict[str, Any]], type_: str) -> dict[str, Any]:
    return next(c for c in conds if c["type"] == type_)


def test_conditions_ready_joining_draining_not_ready() -> None:
    ready = [{"rank": 0, "state": "Ready"}, {"rank": 1, "state": "Ready"}]
    conds = conditions(ready, 2, ScalePlan(2), None, [], "T1")
    assert [(c["type"], c["status"], c["reason"]) for c in conds] == [
        ("Available", "True", "RanksReady"), ("Progressing", "False", "Stable"), ("Degraded", "False", "AsExpected")]
    joining = conditions([*ready, {"rank": 2, "state": "Joining"}], 3, ScalePlan(3), None, [], "T1")
    assert cond(joining, "Progressing")["reason"] == "RanksJoining" and "[2]" in cond(joining, "Progressing")["message"]
    plan = plan_scale(3, 2, {2: "DRAINING"}, {2: 0.0}, now=10.0, drain_timeout=300)
    draining = conditions([*ready, {"rank": 2, "state": "Draining"}], 2, plan, None, [], "T1")
    assert cond(draining, "Progressing")["reason"] == "Draining" and "290s" in cond(draining, "Progressing")["message"]
    broken = conditions([ready[0], {"rank": 1, "state": "NotReady"}], 2, ScalePlan(2), None, [], "T1")
    assert cond(broken, "Degraded")["status"] == "True" and "[1]" in cond(broken, "Degraded")["message"]
    assert cond(broken, "Available")["status"] == "True"  # one rank still serves
    down = conditions(ready, 2, ScalePlan(2), "connection refused", [], "T1")
    assert cond(down, "Available")["status"] == "False" and cond(down, "Degraded")["reason"] == "RouterUnreachable"


def test_last_transition_time_moves_only_with_the_status() -> None:
    first = conditions([{"rank": 0, "state": "Ready"}], 1, ScalePlan(1), None, [], "T1")
    same = conditions([{"rank": 0, "state": "Ready"}], 1, ScalePlan(1), None, first, "T2")
    assert {c["lastTransitionTime"] for c in same} == {"T1"}
    flipped = conditions([{"rank": 0, "state": "NotReady"}], 1, ScalePlan(1), None, same, "T3")
    assert cond(flipped, "Degraded")["lastTransitionTime"] == cond(flipped, "Available")["lastTransitionTime"] == "T3"
    assert merge_conditions([{"type": "Custom", "status": "True"}], [], "T4") == [{"type": "Custom", "status": "True"}]


@pytest.mark.parametrize("previous", [[], [{"type": "Available", "status": "True", "reason": "RanksReady",
                                            "message": "", "lastTransitionTime": "T0"}]])
def test_invalid_spec_conditions(previous: list[dict[str, Any]]) -> None:
    conds = invalid_spec_conditions("spec.model.path is required", previous, "T1")
    assert cond(conds, "Degraded") == {"type": "Degraded", "status": "True", "reason": "InvalidSpec",
                                       "message": "spec.model.path is required", "lastTransitionTime": "T1"}
    assert cond(conds, "Available")["status"] == ("True" if previous else "False")  # running ranks keep serving
