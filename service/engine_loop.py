"""``EngineLoop``: one thread per engine that owns a scheduler and drives its transport.

Other threads talk to it only through thread-safe calls (``submit``, ``abort``); the scheduler
is touched by the loop thread alone. With ``overlap`` the loop keeps up to ``OVERLAP_DEPTH`` steps
in flight: it schedules and sends steps N+1, N+2 while the engine still runs step N (placeholders
stand for tokens not sampled yet; the engine resolves them), so the device never waits for the
network or the scheduler.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from dataclasses import dataclass, field

from modeserve.engine.request import Req
from modeserve.engine.sampling_params import SamplingParams
from modeserve.engine.scheduler.scheduler import ScheduledStep, Scheduler
from modeserve.service.transport import EngineTransport

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class TokenUpdate:
    """New tokens of one request; ``finish_reason`` set on the last update."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: tuple[float, ...] = ()


@dataclass
class RequestHandle:
    req: Req
    updates: queue.Queue[TokenUpdate] = field(default_factory=queue.Queue)


class EngineLoop:
    # Steps in flight with overlap: step N+2 is already queued at the engine while step N's result
    # travels back, so even a round trip over the network leaves the device no gap.
    OVERLAP_DEPTH = 3

    def __init__(self, scheduler: Scheduler, transport: EngineTransport, overlap: bool = True,
                 max_queued_requests: int = 1024, name: str = "engine") -> None:
        self.scheduler = scheduler
        self.transport = transport
        self.depth = self.OVERLAP_DEPTH if overlap else 1
        self.max_queued_requests = max_queued_requests
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._handles: dict[str, RequestHandle] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"loop-{name}", daemon=True)

    # ---- any thread -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def make_request(self, rid: str, prompt_ids: list[int], sampling: SamplingParams) -> Req:
        with self._lock:  # validation reads config; the seed draw uses the scheduler's rng
            return self.scheduler.make_request(rid, prompt_ids, sampling)

    def submit(self, req: Req) -> RequestHandle:
        with self._lock:
            if len(self._handles) >= self.max_queued_requests:
                raise QueueFullError(f"{len(self._handles)} requests in flight (max {self.max_queued_requests})")
            if req.rid in self._handles:
                raise ValueError(f"request_id {req.rid!r} is already in flight")
            handle = RequestHandle(req)
            self._handles[req.rid] = handle
            self._inbox.append(("add", req))
        self._wake.set()
        return handle

    def abort(self, rid: str) -> None:
        with self._lock:
            self._inbox.append(("abort", rid))
        self._wake.set()

    @property
    def num_requests(self) -> int:
        with self._lock:
            return len(self._handles)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.transport.close()

    # ---- loop thread ----------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, arg in items:
            if kind == "add":
                self.scheduler.add_request(arg)  # type: ignore[arg-type]
            else:
                req = self.scheduler.abort(arg)  # type: ignore[arg-type]
                if req is not None:
                    self._deliver(req, (), "abort")

    def _deliver(self, req: Req, tokens: tuple[int, ...], finish_reason: str | None,
                 logprobs: tuple[float, ...] = ()) -> None:
        with self._lock:
            handle = self._handles.get(req.rid)
            if handle is None:
                return
            if finish_reason is not None:
                del self._handles[req.rid]
        handle.updates.put(TokenUpdate(tokens, finish_reason, logprobs))

    def _run(self) -> None:
        in_flight: collections.deque[ScheduledStep] = collections.deque()
        try:
            while not self._stopped:
                self._drain_inbox()
                if len(in_flight) < self.depth:
                    step = self.scheduler.schedule()
                    if step is not None:
                        self.transport.submit(step.batch)
                        in_flight.append(step)
                        continue
                if not in_flight:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                step = in_flight.popleft()
                for ev in self.scheduler.process_result(step, self.transport.receive()):
                    lp = (ev.req.output_logprobs[-1],) if ev.req.output_logprobs else ()
                    self._deliver(ev.req, ev.new_token_ids, ev.req.finish_reason if ev.finished else None, lp)
        except Exception as exc:  # the engine is gone: fail every request rather than hang
            logger.exception("engine loop failed: %s", exc)
            with self._lock:
                handles = list(self._handles.values())
                self._handles.clear()
            for h in handles:
                h.updates.put(TokenUpdate((), "abort"))
