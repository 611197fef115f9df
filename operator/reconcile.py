"""One reconcile of one EngineSet: read the cluster and the router, decide with the pure functions
(``spec``, ``resources``, ``ranks``, ``conditions``), write the decisions back. No kopf here.

Order within a reconcile (the drain-first invariant rests on it):
1. the headless Service, router Deployment and router Service (created or patched);
2. the router's table (GetRanks), then the scale plan;
3. the router's new table (SetRanks: leaving ranks draining, removed ranks left out) -- BEFORE
4. the StatefulSet at the plan's size (never below a rank the router may still use);
5. the status (only written when it changed).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import resources as res
from .conditions import conditions, invalid_spec_conditions
from .kube import Kube
from .ranks import ScalePlan, plan_scale, rank_views, router_ranks
from .router_client import AdminClient, RouterStates, RouterUnreachable, router_address
from .spec import EngineSetSpec, InvalidSpec, parse_spec

Obj = dict[str, Any]
ES_API = f"{res.GROUP}/{res.VERSION}"


@dataclass(frozen=True)
class OperatorConfig:
    """Built once from the command line and the environment (``modeserve operator``)."""
    namespaces: tuple[str, ...]
    reconcile_interval: float = 15.0
    default_image: str = ""
    default_image_pull_policy: str = "IfNotPresent"
    router_timeout: float = 5.0
    router_retry_delay: float = 10.0
    router_service_account: str = ""  # routers run as it and follow their EngineSet's status ("": SetRanks only)

    def __post_init__(self) -> None:
        if not self.namespaces or any(not ns for ns in self.namespaces):
            raise ValueError("operator: give the namespaces to watch (--namespaces a,b)")
        if self.reconcile_interval <= 0 or self.router_timeout <= 0 or self.router_retry_delay <= 0:
            raise ValueError("operator: intervals and timeouts must be > 0")


@dataclass(frozen=True)
class Outcome:
    """What a reconcile did (handlers log it; tests read it)."""
    statefulset_replicas: int
    plan: ScalePlan
    ranks: list[Obj]
    router_error: str | None                # set: the router did not answer (retry soon)
    events: tuple[tuple[str, str], ...] = ()  # (reason, message) worth a Kubernetes Event


def _timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class EngineSetReconciler:
    """Holds what outlives one reconcile: each EngineSet's drain start times (in memory: after an
    operator restart a drain's timeout starts again, so it is never shortened) and a lock per
    EngineSet (kopf runs a timer and change handlers of one object concurrently)."""

    def __init__(self, config: OperatorConfig, kube: Kube, router: AdminClient,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kube = kube
        self.router = router
        self.clock = clock
        self._drains: dict[str, Mapping[int, float]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, uid: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(uid, threading.Lock())

    def parse(self, es: Mapping[str, Any]) -> EngineSetSpec:
        spec = dict(es.get("spec") or {})
        spec.setdefault("imagePullPolicy", self.config.default_image_pull_policy)
        return parse_spec(spec, default_image=self.config.default_image)

    # ---- reconcile ----------------------------------------------------------------------------
    def reconcile(self, es: Mapping[str, Any], logger: logging.Logger | logging.LoggerAdapter) -> Outcome:
        """Raises ``InvalidSpec`` after writing the Degraded condition. An unreachable router is not an
        exception: everything that does not need it is done, and ``Outcome.router_error`` says why."""
        with self._lock(es["metadata"]["uid"]):
            return self._reconcile(es, logger)

    def _reconcile(self, es: Mapping[str, Any], logger: logging.Logger | logging.LoggerAdapter) -> Outcome:
        meta = es["metadata"]
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        previous = (es.get("status") or {}).get("conditions") or []
        events: list[tuple[str, str]] = []
        try:
            spec = self.parse(es)
        except InvalidSpec as exc:
            self._write_status(es, {"observedGeneration": meta.get("generation"),
                                    "conditions": invalid_spec_conditions(str(exc), previous, _timestamp())})
            raise
        router = res.router_deployment(es, spec, self.config.router_service_account)
        owned = [res.engine_configmap(es, spec.replicas), res.engine_service(es), router, res.router_service(es)]
        if spec.network_policy:
            owned.append(res.engine_network_policy(es, spec))
        for obj in owned:
            _, action = self.kube.apply(obj)
            if action != "unchanged":
                events.append((action.capitalize(), f"{obj['kind']} {obj['metadata']['name']} {action}"))

        sts = self.kube.get("apps/v1", "StatefulSet", ns, f"{name}-engine")
        current = int(sts["spec"].get("replicas", 0)) if sts is not None else None
        pods = self.kube.list("v1", "Pod", ns, res.selector(name, "engine"))
        draining_before = frozenset(self._drains.get(uid, {}))
        states, router_error, plan = self._tell_router(es, spec, current, pods)
        _, action = self.kube.apply(res.engine_statefulset(es, spec, plan.statefulset_replicas))
        if action != "unchanged":
            late = f"; ranks {sorted(plan.timed_out)} removed before they drained" if plan.timed_out else ""
            events.append(("Scaled" if sts is not None else "Created",
                           f"StatefulSet {name}-engine {action}: {plan.statefulset_replicas} replicas{late}"))
        if plan.draining and plan.draining != draining_before:
            message = f"ranks {sorted(plan.draining)} draining before the scale-down to {spec.replicas}"
            events.append(("Draining", message))

        views = rank_views(pods, spec.replicas, plan.draining, states, name=name, namespace=ns)
        table = [v.status() for v in views]
        self._write_status(es, {
            "observedGeneration": meta.get("generation"),
            "replicas": sum(1 for v in views if v.pod is not None),
            "readyReplicas": sum(1 for v in views if v.state == "Ready"),
            "selector": res.engine_selector_string(name),
            "ranks": table,
            "conditions": conditions(table, spec.replicas, plan, router_error, previous, _timestamp()),
        })
        for reason, message in events:
            logger.info("%s: %s", reason, message)
        return Outcome(plan.statefulset_replicas, plan, table, router_error, tuple(events))

    def _tell_router(self, es: Mapping[str, Any], spec: EngineSetSpec, current: int | None,
                     pods: list[Obj]) -> tuple[RouterStates | None, str | None, ScalePlan]:
        """GetRanks, plan, SetRanks; (router states or None, router error or None, plan). When the
        router cannot be told, the plan is made again as if it had not answered (drain by timeout)."""
        meta = es["metadata"]
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        address, tls = router_address(name, ns), spec.tls_secret is not None
        started = self._drains.get(uid, {})
        try:
            states: RouterStates | None = self.router.get_ranks(address, tls)
            error = None
        except RouterUnreachable as exc:
            states, error = None, str(exc)
        plan = plan_scale(current, spec.replicas, states, started, self.clock(), spec.drain_timeout_seconds)
        if states is not None:
            views = rank_views(pods, spec.replicas, plan.draining, states, name=name, namespace=ns)
            try:
                states = self.router.set_ranks(address, router_ranks(views, plan.statefulset_replicas), tls)
            except RouterUnreachable as exc:
                states, error = None, str(exc)
                plan = plan_scale(current, spec.replicas, None, started, self.clock(), spec.drain_timeout_seconds)
        self._drains[uid] = plan.drain_started
        return states, error, plan

    def _write_status(self, es: Mapping[str, Any], status: Obj) -> None:
        status = {k: v for k, v in status.items() if v is not None}
        current = es.get("status") or {}
        if all(current.get(k) == v for k, v in status.items()):
            return
        meta = es["metadata"]
        self.kube.patch(ES_API, "EngineSet", meta["namespace"], meta["name"], {"status": status}, subresource="status")

    # ---- delete -------------------------------------------------------------------------------
    def cleanup(self, es: Mapping[str, Any], logger: logging.Logger | logging.LoggerAdapter) -> list[str]:
        """Delete the owned objects now (a cluster's garbage collector would too, through their owner
        references; doing it here makes deletion immediate and independent of the collector)."""
        meta = es["metadata"]
        name, ns = meta["name"], meta["namespace"]
        deleted = []
        for api_version, kind, obj_name in (("apps/v1", "StatefulSet", f"{name}-engine"),
                                            ("apps/v1", "Deployment", f"{name}-router"),
                                            ("v1", "Service", name), ("v1", "Service", f"{name}-engine"),
                                            ("v1", "ConfigMap", f"{name}-engine"),
                                            ("networking.k8s.io/v1", "NetworkPolicy", f"{name}-engine")):
            existing = self.kube.get(api_version, kind, ns, obj_name)
            owners = ((existing or {}).get("metadata") or {}).get("ownerReferences") or []
            if existing is not None and any(o.get("uid") == meta["uid"] for o in owners):
                self.kube.delete(api_version, kind, ns, obj_name)
                deleted.append(f"{kind}/{obj_name}")
        with self._guard:
            self._locks.pop(meta["uid"], None)
        self._drains.pop(meta["uid"], None)
        logger.info("deleted %s", ", ".join(deleted) or "nothing (already gone)")
        return deleted
