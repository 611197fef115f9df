"""Which DP ranks exist, what state each is in, what the router is told, and how far the StatefulSet
may shrink (pure functions: the handlers read the cluster and the router, these decide).

Invariants:
- rank i is pod ``NAME-engine-i`` (its pod-index label, else its name's ordinal suffix);
- the router only ever gets ranks whose pod is Ready; ranks ``>= desired`` go to it as draining;
- the StatefulSet never shrinks past a rank the router may still send requests to: a rank is removed
  only once the router reports it DRAINED, GONE or absent, or once its drain timeout has passed;
- scale-up is never delayed (new pods join the router when they turn Ready).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .resources import POD_INDEX_LABEL, rank_address

Obj = dict[str, Any]

# router states (modeserve.v1.RankState without its prefix) that mean "no request will go there"
SAFE_TO_REMOVE = ("DRAINED", "GONE")
ROUTER_STATE_TO_STATUS = {"JOINING": "Joining", "READY": "Ready", "DRAINING": "Draining", "DRAINED": "Drained",
                          "GONE": "NotReady"}


class RouterRank(NamedTuple):
    """One entry of ``Admin.SetRanks``."""
    rank: int
    address: str
    draining: bool


@dataclass(frozen=True)
class RankView:
    """One rank as the operator sees it; ``status()`` is its entry in ``status.ranks``."""
    rank: int
    address: str
    state: str                 # Joining | Ready | NotReady | Draining | Drained
    pod: str | None = None
    pod_ready: bool = False
    router_state: str | None = None  # None: the router does not list it (or was not reachable)
    draining: bool = False     # rank >= desired replicas: on its way out

    def status(self) -> Obj:
        """``podReady`` lets a router that follows the status tell a Joining rank it connects to (pod
        Ready, the router is joining it) from one without an engine yet (``service.engineset_watch``)."""
        entry: Obj = {"rank": self.rank, "address": self.address, "state": self.state, "podReady": self.pod_ready}
        if self.pod is not None:
            entry["pod"] = self.pod
        return entry


# ---- pods ---------------------------------------------------------------------------------------
def pod_rank(pod: Mapping[str, Any]) -> int | None:
    """The pod's rank: its pod-index label, else the ordinal after the last '-' of its name."""
    meta = pod.get("metadata") or {}
    index = (meta.get("labels") or {}).get(POD_INDEX_LABEL)
    if index is not None and str(index).isdigit():
        return int(index)
    suffix = str(meta.get("name", "")).rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else None


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pod_is_starting(pod: Mapping[str, Any]) -> bool:
    """Pending, or running with a container whose startup probe has not passed yet (model loading)."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    if status.get("phase") == "Pending":
        return True
    containers = status.get("containerStatuses") or []
    return status.get("phase") == "Running" and any(not c.get("started") for c in containers)


# ---- the rank table -----------------------------------------------------------------------------
def _state(pod: Mapping[str, Any] | None, draining: bool, router_state: str | None, router_known: bool) -> str:
    ready = pod is not None and pod_is_ready(pod)
    if draining:
        if not ready or (router_known and router_state in (None, *SAFE_TO_REMOVE)):
            return "Drained"
        return "Draining"
    if pod is None or (not ready and pod_is_starting(pod)):
        return "Joining"
    if not ready:
        return "NotReady"
    if not router_known:
        return "Ready"  # the pod is Ready; the router's view is unknown (see the Degraded condition)
    return ROUTER_STATE_TO_STATUS.get(router_state or "", "Joining")  # not in the router yet: it joins


def rank_views(pods: Sequence[Mapping[str, Any]], replicas: int, draining: set[int] | frozenset[int],
               router_states: Mapping[int, str] | None, *, name: str = "", namespace: str = "") -> list[RankView]:
    """Ranks ``0..replicas-1`` (with or without a pod) plus every rank that still has a pod.

    ``router_states`` is the router's table (rank -> JOINING/READY/DRAINING/DRAINED/GONE), or None when
    the router could not be asked. Ranks in ``draining`` or ``>= replicas`` are on their way out; one
    of those without a pod is gone and not listed. ``name``/``namespace`` default to the pods' own.
    """
    by_rank: dict[int, Mapping[str, Any]] = {}
    for pod in pods:
        rank = pod_rank(pod)
        if rank is not None:
            by_rank[rank] = pod
            meta = pod.get("metadata") or {}
            name = name or (meta.get("labels") or {}).get("modeserve.io/engineset", "")
            namespace = namespace or meta.get("namespace", "")
    router_known = router_states is not None
    states = router_states or {}
    views = []
    for rank in sorted(set(range(replicas)) | set(by_rank)):
        found = by_rank.get(rank)
        leaving = rank >= replicas or rank in draining
        if leaving and found is None:
            continue
        router_state = states.get(rank)
        views.append(RankView(
            rank=rank, address=rank_address(name, namespace, rank),
            state=_state(found, leaving, router_state, router_known),
            pod=(found.get("metadata") or {}).get("name") if found is not None else None,
            pod_ready=found is not None and pod_is_ready(found), router_state=router_state, draining=leaving))
    return views


def rank_table(pods: Sequence[Mapping[str, Any]], replicas: int, draining: set[int] | frozenset[int],
               router_states: Mapping[int, str] | None, *, name: str = "", namespace: str = "") -> list[Obj]:
    """``status.ranks``: [{rank, pod, address, state, podReady}] sorted by rank (see ``rank_views``)."""
    return [v.status() for v in rank_views(pods, replicas, draining, router_states, name=name, namespace=namespace)]


def router_ranks(views: Sequence[RankView], statefulset_replicas: int) -> list[RouterRank]:
    """What ``Admin.SetRanks`` gets: ranks with a Ready pod below the StatefulSet's size.

    Left out (so the router drops them at once and moves their requests on): ranks whose pod is not
    Ready, ranks the router reports GONE (they are offered again on the next reconcile, as new), ranks
    at or above ``statefulset_replicas`` (about to be removed), and leaving ranks the router no longer
    lists. Leaving ranks that remain are sent with ``draining=True``.
    """
    out = []
    for v in views:
        if v.rank >= statefulset_replicas or not v.pod_ready or v.router_state == "GONE":
            continue
        if v.draining and v.router_state is None:
            continue
        out.append(RouterRank(v.rank, v.address, v.draining))
    return out


# ---- scaling ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScalePlan:
    """What to do now. ``drain_started`` is what to remember for the next reconcile."""
    statefulset_replicas: int
    draining: frozenset[int] = frozenset()    # ranks the router must stop sending to (>= desired)
    waiting: frozenset[int] = frozenset()     # draining ranks not yet safe to remove
    timed_out: frozenset[int] = frozenset()   # removed although the router did not report them drained
    drain_started: Mapping[int, float] = field(default_factory=dict)
    seconds_left: float | None = None         # until the oldest waiting drain times out


def plan_scale(current_replicas: int | None, desired_replicas: int, router_status: Mapping[int, str] | None,
               drain_started: Mapping[int, float], now: float, drain_timeout: float) -> ScalePlan:
    """Scale-up (or no StatefulSet yet): ``desired`` at once. Scale-down: ranks ``desired..current-1``
    drain first; the StatefulSet shrinks to the lowest rank above which every rank is safe to remove:
    the router (``router_status``: rank -> state; None when unreachable) reports it DRAINED or GONE or
    no longer lists it, or ``drain_timeout`` seconds have passed since ``drain_started[rank]``
    (``now`` on the first reconcile that saw it leave)."""
    if current_replicas is None or desired_replicas >= current_replicas:
        return ScalePlan(statefulset_replicas=desired_replicas)
    leaving = range(desired_replicas, current_replicas)
    started = {r: drain_started.get(r, now) for r in leaving}

    def drained(rank: int) -> bool:
        return router_status is not None and router_status.get(rank) in (None, *SAFE_TO_REMOVE)

    def expired(rank: int) -> bool:
        return now - started[rank] >= drain_timeout

    keep = current_replicas
    while keep > desired_replicas and (drained(keep - 1) or expired(keep - 1)):
        keep -= 1
    waiting = frozenset(r for r in leaving if not (drained(r) or expired(r)))
    timed_out = frozenset(r for r in range(keep, current_replicas) if not drained(r))
    left = min((started[r] + drain_timeout - now for r in waiting), default=None)
    return ScalePlan(statefulset_replicas=keep, draining=frozenset(leaving), waiting=waiting,
                     timed_out=timed_out, drain_started=started, seconds_left=left)
