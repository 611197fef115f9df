"""The router's ranks from Kubernetes: follow one EngineSet's ``status.ranks`` (the table the operator
publishes) and apply each new table through ``RankTable.set_ranks``, the call ``Admin.SetRanks`` makes:
both paths mean the same and converge on the same table (applying it twice changes nothing).

List, then watch from the list's resourceVersion. A watch the server ends (its timeout) is resumed
from the last version seen; 410 Gone (that version expired) lists again; any other error (connection
refused or reset, 5xx, 403) waits with exponential backoff, capped, and lists again. One daemon
thread; ``stop()`` ends it.

Which entries become ranks (``ranks_from_status``) is what the operator sends with SetRanks
(``operator.ranks.router_ranks``), read back from the states it publishes:
- Ready: takes requests; Draining: takes none, finishes its running ones;
- Joining: joins once its pod is Ready (``podReady``: the router connects and waits for SERVING);
  before that there is no engine to connect to;
- NotReady and Drained: left out, so removed (a failed rank's requests move on; a drained one has none).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from .rank_table import RankSpec

logger = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "modeserve.io", "v1alpha1", "enginesets"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
Apply = Callable[[list[RankSpec]], None]
Obj = dict[str, Any]


def ranks_from_status(status: Mapping[str, Any] | None) -> list[RankSpec] | None:
    """The router's table from an EngineSet's status, by rank; None while none is published."""
    entries = (status or {}).get("ranks")
    if entries is None:
        return None
    specs = []
    for entry in entries:
        rank, address, state = entry.get("rank"), entry.get("address"), entry.get("state")
        if not isinstance(rank, int) or rank < 0 or not address:
            continue
        if state == "Ready" or (state == "Joining" and entry.get("podReady") is True):
            specs.append(RankSpec(rank, address))
        elif state == "Draining":
            specs.append(RankSpec(rank, address, draining=True))
    return sorted(specs, key=lambda s: s.rank)


def pod_namespace(env: Mapping[str, str] = os.environ, path: Path | None = None) -> str | None:
    """This pod's namespace: ``$POD_NAMESPACE``, else its service account's namespace file."""
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    try:
        return (path or NAMESPACE_FILE).read_text().strip() or None
    except OSError:
        return None


def api_client_from_environment(env: Mapping[str, str] = os.environ) -> k8s.ApiClient:
    """In-cluster service account, else ``$KUBECONFIG`` or ``~/.kube/config`` (the order the operator
    logs in with); the client's global default configuration is left alone."""
    config = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=config)
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(config_file=env.get("KUBECONFIG"), client_configuration=config)
    return k8s.ApiClient(config)


class EngineSetWatch:
    """List + watch EngineSet ``namespace/name`` in a daemon thread; keep its latest rank table.

    ``wait_ranks`` blocks until a published table lists a rank (the router learns the model from one);
    ``follow(apply)`` sends the latest table to ``apply`` at once and then every table that differs
    from the last one applied (kopf's annotation patches and spec edits change the object, not the
    table: those are not applied again).
    """

    def __init__(self, api: k8s.ApiClient, namespace: str, name: str, *, watch_seconds: int = 300,
                 min_backoff: float = 0.5, max_backoff: float = 30.0) -> None:
        if not namespace or not name:
            raise ValueError("EngineSet watch: needs a namespace and a name")
        if watch_seconds <= 0 or not 0 < min_backoff <= max_backoff:
            raise ValueError("EngineSet watch: watch_seconds > 0 and 0 < min_backoff <= max_backoff")
        self.namespace, self.name = namespace, name
        self._api = k8s.CustomObjectsApi(api)
        self._watch_seconds = watch_seconds
        self._min_backoff, self._max_backoff = min_backoff, max_backoff
        self._cond = threading.Condition()
        self._latest: list[RankSpec] | None = None
        self._applied: list[RankSpec] | None = None
        self._apply: Apply | None = None
        self._stopped = threading.Event()
        self._stream: k8s_watch.Watch | None = None
        self._thread = threading.Thread(target=self._run, name=f"engineset-watch-{name}", daemon=True)

    # ---- the router's side --------------------------------------------------------------------
    def start(self) -> EngineSetWatch:
        self._thread.start()
        return self

    def wait_ranks(self, timeout: float) -> list[RankSpec]:
        """The first published table that lists a rank (``TimeoutError`` after ``timeout`` seconds)."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._latest) or self._stopped.is_set(), timeout):
                raise TimeoutError(f"EngineSet {self.namespace}/{self.name} listed no rank within {timeout:.0f}s")
            if self._stopped.is_set() or not self._latest:
                raise RuntimeError("EngineSet watch stopped")
            return list(self._latest)

    def follow(self, apply: Apply) -> None:
        with self._cond:
            self._apply = apply
            self._deliver()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        with self._cond:
            self._cond.notify_all()
        stream = self._stream
        if stream is not None:
            stream.stop()  # shuts the socket: the blocked read returns
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- tables -------------------------------------------------------------------------------
    def _observe(self, obj: Obj) -> None:
        meta = obj.get("metadata") or {}
        if meta.get("name") != self.name or meta.get("namespace", self.namespace) != self.namespace:
            return  # the API server filters by name; this is for servers that do not
        table = ranks_from_status(obj.get("status"))
        if table is None:
            return  # the operator has not published one yet
        with self._cond:
            self._latest = table
            self._cond.notify_all()
            self._deliver()

    def _deliver(self) -> None:
        """Apply the latest table if it is new (called with ``_cond`` held: one apply at a time)."""
        if self._apply is None or self._latest is None or self._latest == self._applied:
            return
        try:
            self._apply(list(self._latest))
        except Exception as exc:  # e.g. a rank listed twice: the table stays as it was
            logger.error("EngineSet %s/%s: rank table not applied: %s", self.namespace, self.name, exc)
            return
        self._applied = self._latest
        logger.info("EngineSet %s/%s: ranks %s", self.namespace, self.name,
                    ", ".join(f"{s.rank}{' (draining)' if s.draining else ''}" for s in self._latest) or "none")

    # ---- list + watch -------------------------------------------------------------------------
    def _run(self) -> None:
        delay = self._min_backoff
        while not self._stopped.is_set():
            try:
                version = self._list()
                delay = self._min_backoff
                while not self._stopped.is_set():
                    version = self._watch(version)  # ended by the server: resume from the last version
            except ApiException as exc:
                if exc.status == 410:
                    logger.info("EngineSet %s/%s: watch expired (410 Gone); listing again", self.namespace, self.name)
                    delay = self._min_backoff
                elif not self._stopped.is_set():
                    logger.warning("EngineSet %s/%s: %s %s; again in %.1fs", self.namespace, self.name, exc.status,
                                   exc.reason, delay)
            except Exception as exc:  # connection refused or reset, read timeout
                if not self._stopped.is_set():
                    logger.warning("EngineSet %s/%s: %s; again in %.1fs", self.namespace, self.name, exc, delay)
            if self._stopped.wait(delay):
                break
            delay = min(2 * delay, self._max_backoff)

    def _selector(self) -> Obj:
        return {"field_selector": f"metadata.name={self.name}"}

    def _list(self) -> str:
        """Observe the EngineSet as it is now; the list's resourceVersion."""
        found = cast(Obj, self._api.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                                  **self._selector(), _request_timeout=30))
        for obj in found.get("items") or []:
            self._observe(obj)
        return str((found.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        """One watch from ``version`` until the server ends it; the last version seen."""
        stream = k8s_watch.Watch()
        self._stream = stream
        if self._stopped.is_set():
            return version
        kwargs: Obj = {**self._selector(), "timeout_seconds": self._watch_seconds, "allow_watch_bookmarks": True,
                       "_request_timeout": (10, self._watch_seconds + 30)}
        if version:
            kwargs["resource_version"] = version
        # a 410 ERROR event is raised as ApiException(410): timeout_seconds turns off the client's own retry
        for event in stream.stream(self._api.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                                   **kwargs):
            obj = event["raw_object"]
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if event["type"] in ("ADDED", "MODIFIED"):
                self._observe(obj)
            elif event["type"] == "DELETED" and (obj.get("metadata") or {}).get("name") == self.name:
                logger.warning("EngineSet %s/%s deleted; the ranks stay as they are", self.namespace, self.name)
        return version
