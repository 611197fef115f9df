"""The rank table the router reads back from its EngineSet's status (``ranks_from_status``) is the one
the operator pushes with SetRanks: status states map to router ranks; through scale-up, scale-down,
a drain (finished or timed out) and a failed pod, the table from the status is the pushed table, and
a rank the router reports GONE is offered again one reconcile sooner. Pure functions, no emulator;
also the router's namespace from the environment or the service-account file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modeserve.operator.ranks import RouterRank, rank_views, router_ranks
from modeserve.service.router.engineset_watch import pod_namespace, ranks_from_status
from modeserve.service.router.rank_table import RankSpec
from tests.service.engineset_cluster import NAME, NS, spec, status_entry


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
