"""The router's DP ranks: rank -> engine address and state, changed at run time.

A rank joins (JOINING) until its engine reports SERVING, then takes requests (READY). DRAINING
takes none and finishes what it runs (DRAINED when empty). A rank whose engine fails (its stream
breaks or its health check fails) is GONE, and one left out of a new table is removed: in both cases
its requests continue on the other ranks from the tokens the router already holds.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ...proto.v1 import admin_pb2
from .dispatch import Dispatcher
from .rank_loop import RankLoop
from .request_handle import Post, RequestHandle, TokenUpdate, send_updates
from ..telemetry.metrics import RankSample

logger = logging.getLogger(__name__)


class RankState(enum.Enum):
    JOINING = 1
    READY = 2
    DRAINING = 3
    DRAINED = 4
    GONE = 5


@dataclass(frozen=True)
class RankSpec:
    rank: int
    address: str
    draining: bool = False


@dataclass
class Rank:
    rank: int
    address: str
    state: RankState
    loop: RankLoop | None = None
    error: str = ""
    draining_requested: bool = False


# connect(rank, address, on_failure) -> a started-ready RankLoop (blocks until the engine serves)
Connect = Callable[[int, str, Callable[[RankLoop, list[RequestHandle]], None]], RankLoop]


class RankTable:
    def __init__(self, connect: Connect, dispatcher: Dispatcher, health: Callable[[str], bool] | None = None,
                 health_interval: float = 1.0, health_failures: int = 3, post: Post | None = None) -> None:
        self._connect = connect
        self.post = post  # how updates reach the request streams (the router's event loop)
        self.dispatcher = dispatcher
        self._health = health
        self._health_interval = health_interval
        self._health_failures = health_failures
        self._lock = threading.Lock()
        self._ranks: dict[int, Rank] = {}
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="rank-watch", daemon=True)
        self._watcher.start()

    # ---- changes ------------------------------------------------------------------------------
    def set_ranks(self, specs: Sequence[RankSpec]) -> None:
        """Make the table equal ``specs`` (new ranks join in the background)."""
        wanted = {s.rank: s for s in specs}
        if len(wanted) != len(specs):
            raise ValueError("rank numbers must be unique")
        removed: list[Rank] = []
        joining: list[Rank] = []
        with self._lock:
            for num, rank in list(self._ranks.items()):
                spec = wanted.get(num)
                if spec is None or spec.address != rank.address:
                    removed.append(self._ranks.pop(num))
            for num, spec in wanted.items():
                existing = self._ranks.get(num)
                if existing is None:
                    new = Rank(num, spec.address, RankState.JOINING, draining_requested=spec.draining)
                    self._ranks[num] = new
                    joining.append(new)
                    continue
                rank = existing
                rank.draining_requested = spec.draining
                if spec.draining and rank.state == RankState.READY:
                    rank.state = RankState.DRAINING
                elif not spec.draining and rank.state == RankState.DRAINING:
                    rank.state = RankState.READY
                elif not spec.draining and rank.state == RankState.DRAINED:  # its stream was closed: rejoin
                    rank.state, rank.loop = RankState.JOINING, None
                    joining.append(rank)
                elif rank.state == RankState.GONE:  # failed earlier and offered again (a restarted pod): rejoin
                    rank.state, rank.loop, rank.error = RankState.JOINING, None, ""
                    joining.append(rank)
        for rank in removed:
            self._remove(rank)
        for rank in joining:
            threading.Thread(target=self._join, args=(rank,), name=f"join-rank-{rank.rank}", daemon=True).start()

    def wait_ready(self, timeout: float) -> None:
        """Until no rank is JOINING (``TimeoutError`` after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while any(r.state == RankState.JOINING for r in self.ranks()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine ranks still joining after {timeout:.0f}s")
            time.sleep(0.05)

    def _join(self, rank: Rank) -> None:
        try:
            loop = self._connect(rank.rank, rank.address, self._on_failure)
        except Exception as exc:  # unreachable or never SERVING: the rank is unusable
            logger.warning("rank %d (%s) failed to join: %s", rank.rank, rank.address, exc)
            with self._lock:
                rank.state, rank.error = RankState.GONE, f"join failed: {exc}"
            return
        with self._lock:
            if self._ranks.get(rank.rank) is not rank:  # removed while joining
                stale = True
            else:
                stale = False
                rank.loop = loop
                rank.state = RankState.DRAINING if rank.draining_requested else RankState.READY
        if stale:
            loop.stop()
        else:
            logger.info("rank %d (%s) is %s", rank.rank, rank.address, rank.state.name)

    def _remove(self, rank: Rank) -> None:
        if rank.loop is None:
            return
        handles = rank.loop.evict()
        logger.info("rank %d (%s) removed; %d requests move on", rank.rank, rank.address, len(handles))
        self._move(handles)

    def _on_failure(self, loop: RankLoop, handles: list[RequestHandle]) -> None:
        error = loop.error or "failed"
        with self._lock:
            for rank in self._ranks.values():
                if rank.loop is loop:
                    rank.state, rank.error = RankState.GONE, error
        logger.warning("engine %s failed (%s); %d requests move on", loop.name, loop.error, len(handles))
        self._move(handles)

    def _move(self, handles: list[RequestHandle]) -> None:
        lost = []
        for handle in handles:
            try:
                self.dispatcher.choose(self.ready_loops(), handle.req.fill_ids).resume(handle)
            except Exception as exc:  # no rank left (or the chosen one just stopped): end the stream
                logger.warning("request %s cannot continue: %s", handle.req.rid, exc)
                lost.append((handle, TokenUpdate((), "abort")))
        send_updates(self.post, lost)

    # ---- reads --------------------------------------------------------------------------------
    def ranks(self) -> list[Rank]:
        with self._lock:
            return sorted(self._ranks.values(), key=lambda r: r.rank)

    def ready_loops(self) -> list[RankLoop]:
        return [r.loop for r in self.ranks() if r.state == RankState.READY and r.loop is not None and r.loop.alive]

    def all_loops(self) -> list[RankLoop]:
        return [r.loop for r in self.ranks() if r.loop is not None]

    def status(self) -> list[admin_pb2.RankStatus]:
        """Each rank as the Admin API reports it."""
        out = []
        for r in self.ranks():
            loop = r.loop
            requests = loop.num_requests if loop is not None else 0
            state = r.state
            if state == RankState.DRAINING and requests == 0:
                state = RankState.DRAINED  # the watcher closes its stream on its next round
            hits = loop.snapshot.prefix_hit_tokens if loop is not None else 0
            out.append(admin_pb2.RankStatus(
                rank=r.rank, address=r.address, state=admin_pb2.RankState.Value(f"RANK_STATE_{state.name}"),
                requests=requests, load_tokens=loop.load_tokens if loop else 0, prefix_hit_tokens=hits, error=r.error))
        return out

    # ---- watch --------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Each interval: close the stream of a drained rank (so its engine sees no stream and can
        stop), and check the health of the others."""
        misses: dict[int, int] = {}
        while not self._closed.wait(self._health_interval):
            for rank in self.ranks():
                if rank.loop is None or rank.state in (RankState.JOINING, RankState.GONE, RankState.DRAINED):
                    continue
                if rank.state == RankState.DRAINING and rank.loop.num_requests == 0:
                    with self._lock:
                        rank.state = RankState.DRAINED
                    rank.loop.stop()
                    continue
                if self._health is None:
                    continue
                ok = self._health(rank.address)
                misses[rank.rank] = 0 if ok else misses.get(rank.rank, 0) + 1
                if misses[rank.rank] >= self._health_failures:
                    logger.warning("rank %d (%s) failed %d health checks", rank.rank, rank.address, misses[rank.rank])
                    misses[rank.rank] = 0
                    with self._lock:
                        rank.state, rank.error = RankState.GONE, "health check failed"
                    self._move(rank.loop.evict())

    def samples(self) -> list[RankSample]:
        """Per-rank metrics of the ranks with a scheduler (for /metrics)."""
        return [r.loop.rank_sample(str(r.rank)) for r in self.ranks() if r.loop is not None]

    def abort(self, rid: str) -> None:
        for loop in self.all_loops():
            loop.abort(rid)

    def close(self) -> None:
        self._closed.set()
        for loop in self.all_loops():
            loop.stop()
