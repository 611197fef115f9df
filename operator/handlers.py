"""kopf handlers for EngineSets, thin over ``EngineSetReconciler``: registered on a registry of their
own (no module-level state), with the operator's kopf settings.

- create / resume / update: reconcile; an invalid spec is a ``PermanentError`` (Degraded is written
  first; kopf waits for the next spec change), an unreachable router a ``TemporaryError``;
- a timer every ``reconcile_interval`` seconds: reconcile the actual state (pods, router), not only
  events; an invalid spec is not retried there;
- delete: the owned objects are deleted explicitly (see ``EngineSetReconciler.cleanup``). The timer
  needs kopf's finalizer anyway, so this handler adds no extra blocking to deletion.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import kopf

from .reconcile import EngineSetReconciler
from .resources import GROUP, VERSION
from .spec import InvalidSpec

PLURAL = "enginesets"
FINALIZER = "modeserve.io/engineset-cleanup"
LoginFn = Callable[..., Any]


def operator_settings() -> kopf.OperatorSettings:
    """Standalone (one operator Deployment replica, no peering objects), Events posted, kopf's own
    bookkeeping in ``modeserve.io`` annotations (the status holds only what the CRD declares), the
    configured namespaces taken as exact names."""
    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    # watch exactly the configured namespaces and the CRDs present at start: no cluster-wide
    # namespace/CRD watching, which the chart's least-privilege RBAC does not grant
    settings.scanning.disabled = True
    # Events: the reconciler's changes (kopf.event), and handler warnings and errors (invalid spec,
    # router unreachable) from the object logger -- not "Timer succeeded" every interval
    settings.posting.enabled = True
    settings.posting.loggers = True
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.execution.max_workers = 8
    return settings


def create_registry(reconciler: EngineSetReconciler, login: LoginFn | None = None) -> kopf.OperatorRegistry:
    """The handlers over ``reconciler``; ``login`` defaults to the ``kubernetes`` client's credentials
    (in-cluster service account, else kubeconfig): the ones ``Kube.from_environment`` uses."""
    registry = kopf.OperatorRegistry()
    config = reconciler.config
    kopf.on.login(registry=registry)(login or kopf.login_via_client)

    def reconcile(body: kopf.Body, logger: Any) -> None:
        outcome = reconciler.reconcile(copy.deepcopy(dict(body)), logger)
        for reason, message in outcome.events:
            kopf.event(body, type="Normal", reason=reason, message=message)  # whatever posting.level says
        if outcome.router_error is not None:
            raise kopf.TemporaryError(outcome.router_error, delay=config.router_retry_delay)

    @kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile-resume", registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile-create", registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, id="reconcile-update", registry=registry)
    def on_change(body: kopf.Body, logger: Any, **_: Any) -> None:
        try:
            reconcile(body, logger)
        except InvalidSpec as exc:
            raise kopf.PermanentError(f"invalid spec: {exc}") from exc

    @kopf.timer(GROUP, VERSION, PLURAL, id="reconcile-timer", interval=config.reconcile_interval,
                registry=registry)
    def on_timer(body: kopf.Body, logger: Any, **_: Any) -> None:
        try:
            reconcile(body, logger)
        except InvalidSpec:
            pass  # already reported (Degraded) by the change handler; waits for a spec change

    @kopf.on.delete(GROUP, VERSION, PLURAL, id="cleanup", registry=registry)
    def on_delete(body: kopf.Body, logger: Any, **_: Any) -> None:
        reconciler.cleanup(copy.deepcopy(dict(body)), logger)

    return registry
