"""``EngineLoop``: one thread per engine that owns a scheduler and drives its transport.

Other threads talk to it only through thread-safe calls (``submit``, ``abort``); the scheduler
is touched by the loop thread alone. With ``overlap`` the loop keeps up to ``OVERLAP_DEPTH`` steps
in flight: it schedules and sends steps N+1, N+2 while the engine still runs step N (placeholders
stand for tokens not sampled yet; the engine resolves them), so the device never waits for the
network or the scheduler.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from opentelemetry.trace import Span

from ...engine.forward_batch import ForwardBatch, ForwardResult
from ...engine.request import Req
from ...engine.sampling_params import SamplingParams
from ...engine.scheduler.scheduler import ScheduledStep, Scheduler
from .lockstep import LockstepGroup, StepOffer
from ..telemetry.metrics import RankSample
from ..telemetry.step_tracing import RequestTrace, StepTracer
from ..telemetry.tracing import Tracing
from ..rpc.transport import EngineTransport

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
    updates: queue.SimpleQueue[TokenUpdate] = field(default_factory=queue.SimpleQueue)
    span: Span | None = None  # the router's request span, when tracing is on
    trace: RequestTrace | None = field(init=False, default=None)  # the span and its step links

    def __post_init__(self) -> None:
        if self.span is not None:
            self.trace = RequestTrace(self.span)

    def link_steps(self) -> None:
        """Add the links to the steps so far (before the span ends): the engine loop calls it, and
        the router when a client goes away."""
        if self.trace is not None:
            self.trace.finish()


class EngineLoop:
    # Steps in flight with overlap: step N+2 is already queued at the engine while step N's result
    # travels back, so even a round trip over the network leaves the device no gap.
    OVERLAP_DEPTH = 3

    def __init__(self, scheduler: Scheduler, transport: EngineTransport, overlap: bool = True,
                 max_queued_requests: int = 1024, name: str = "engine",
                 on_failure: Callable[[EngineLoop, list[RequestHandle]], None] | None = None,
                 lockstep: LockstepGroup | None = None, graph_batch_sizes: Sequence[int] = (),
                 tracing: Tracing | None = None, dp_rank: int = 0) -> None:
        self.scheduler = scheduler
        self.transport = transport
        self.name = name
        self.depth = self.OVERLAP_DEPTH if overlap else 1
        self.max_queued_requests = max_queued_requests
        self.on_failure = on_failure
        self.lockstep = lockstep
        self.graph_batch_sizes = sorted(graph_batch_sizes)
        self.step_tracer = StepTracer(tracing, dp_rank, transport.in_process) if tracing is not None else None
        self.dp_rank = dp_rank
        self.error: str | None = None
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards the inbox, the handles and the load counter
        self._sched_lock = threading.Lock()  # the loop thread holds it while it touches the scheduler
        self._handles: dict[str, RequestHandle] = {}
        self._last_result = 0.0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"loop-{name}", daemon=True)

    # ---- any thread -----------------------------------------------------------------------
    def start(self) -> None:
        if self.lockstep is not None:
            self.lockstep.join(self.name)
        self._thread.start()

    def make_request(self, rid: str, prompt_ids: list[int], sampling: SamplingParams) -> Req:
        with self._sched_lock:  # validation reads config; the seed draw uses the scheduler's rng
            return self.scheduler.make_request(rid, prompt_ids, sampling)

    def submit(self, req: Req, span: Span | None = None) -> RequestHandle:
        return self._adopt(RequestHandle(req, span=span), check_capacity=True)

    def resume(self, handle: RequestHandle) -> None:
        """Continue another rank's request here: its delivered tokens are recomputed (like a
        preempted request), then generation goes on into the same handle; nothing is sent twice."""
        handle.req = continuation(handle.req)
        self._adopt(handle, check_capacity=False)

    def _adopt(self, handle: RequestHandle, check_capacity: bool) -> RequestHandle:
        req = handle.req
        with self._lock:
            if self._stopped:
                raise QueueFullError(f"engine {self.name} is stopped")
            if check_capacity and len(self._handles) >= self.max_queued_requests:
                raise QueueFullError(f"{len(self._handles)} requests in flight (max {self.max_queued_requests})")
            if req.rid in self._handles:
                raise ValueError(f"request_id {req.rid!r} is already in flight")
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

    @property
    def load_tokens(self) -> int:
        """Prompt + generated tokens of the requests queued or running here (dispatch weighs it)."""
        with self._lock:
            return sum(h.req.fill_len for h in self._handles.values())

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def rank_sample(self, rank: str) -> RankSample:
        """Gauges and step statistics for /metrics (read without the lock: a scrape may be a step late)."""
        sched = self.scheduler
        kv = sched.kv
        idle_pages = kv.pool.num_free_pages + (kv.cache.num_evictable_pages if kv.cache is not None else 0)
        usage = 1.0 - idle_pages / max(kv.pool.num_total_pages, 1)
        return RankSample(rank, sched.stats, queued=len(sched.waiting), running=len(sched.running), kv_usage=usage)

    def cached_prefix_len(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` this rank's prefix cache holds now (exact: read under the lock)."""
        with self._sched_lock:
            return self.scheduler.kv.cached_prefix_len(token_ids)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self.lockstep is not None:
            self.lockstep.leave(self.name)
        self.transport.close()

    def evict(self) -> list[RequestHandle]:
        """Stop this rank and hand over what it still had (to resume elsewhere)."""
        self.stop()
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        return handles

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
            if handle is None or handle.req is not req:
                return
            if finish_reason is not None:
                del self._handles[req.rid]
        if finish_reason is not None:
            handle.link_steps()  # before the router ends the span
        handle.updates.put(TokenUpdate(tokens, finish_reason, logprobs))

    def _process(self, step: ScheduledStep, started: float, span: Span | None, result: ForwardResult) -> None:
        """Deliver a step's tokens; its time counts from when it could start: its submission, or
        the previous result if that came later (steps in flight run one after the other)."""
        if span is not None and self.step_tracer is not None:
            self.step_tracer.end(span, result)
        now = time.perf_counter()
        self.scheduler.stats.add_time(step.batch.forward_mode, now - max(started, self._last_result))
        self._last_result = now
        for ev in self.scheduler.process_result(step, result):
            lp = (ev.req.output_logprobs[-1],) if ev.req.output_logprobs else ()
            self._deliver(ev.req, ev.new_token_ids, ev.req.finish_reason if ev.finished else None, lp)

    def _run(self) -> None:
        try:
            if self.lockstep is None:
                self._run_free()
            else:
                self._run_lockstep(self.lockstep)
        except Exception as exc:  # the engine is gone: its requests continue elsewhere, or end
            logger.exception("engine loop %s failed: %s", self.name, exc)
            self._fail(f"{type(exc).__name__}: {exc}")

    def _run_free(self) -> None:
        in_flight: collections.deque[tuple[ScheduledStep, float, Span | None]] = collections.deque()
        while not self._stopped:
            with self._sched_lock:
                self._drain_inbox()
                step = self.scheduler.schedule() if len(in_flight) < self.depth else None
                if step is not None:
                    batch, span = self._traced(step.batch, step)
                    self.transport.submit(batch)
                    in_flight.append((step, time.perf_counter(), span))
                    continue
            if not in_flight:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            result = self.transport.receive()
            with self._sched_lock:
                self._process(*in_flight.popleft(), result=result)

    def _run_lockstep(self, group: LockstepGroup) -> None:
        """One step at a time, agreed with the other ranks: a rank without work runs IDLE, and a
        CUDA-graph step is padded to the bucket every rank replays."""
        while not self._stopped:
            with self._sched_lock:
                self._drain_inbox()
                step = self.scheduler.schedule()
            agreement = None
            offer = StepOffer(step is not None, self._graph_rows(step))
            while agreement is None and not self._stopped:
                agreement = group.exchange(self.name, offer)
            if agreement is None:
                return
            if not agreement.any_work:
                self._wake.wait(timeout=0.02)
                self._wake.clear()
                continue
            with self._sched_lock:
                if step is None:
                    step = self.scheduler.schedule(idle_if_empty=True)
                    assert step is not None
            started = time.perf_counter()
            batch, span = self._traced(dataclasses.replace(step.batch, padded_batch_size=agreement.padded_batch_size),
                                       step)
            self.transport.submit(batch)
            result = self.transport.receive()
            with self._sched_lock:
                self._process(step, started, span, result)

    def _traced(self, batch: ForwardBatch, step: ScheduledStep) -> tuple[ForwardBatch, Span | None]:
        """The step's span and the batch to send (``StepTracer.start``), with tracing on."""
        if self.step_tracer is None or not self.step_tracer.enabled or not step.reqs:
            return batch, None
        with self._lock:
            handles = [self._handles.get(r.rid) for r in step.reqs]
        return self.step_tracer.start(batch, [h.trace for h in handles if h is not None and h.trace is not None])

    def _graph_rows(self, step: ScheduledStep | None) -> int:
        """Rows this step would replay in a CUDA graph (0 when idle), -1 if it runs eagerly."""
        if step is None:
            return 0
        batch = step.batch
        if not batch.forward_mode.traits.uses_cuda_graph or not self.graph_batch_sizes:
            return -1
        return batch.batch_size if batch.batch_size <= self.graph_batch_sizes[-1] else -1

    def _fail(self, error: str) -> None:
        self.error = error
        if self.lockstep is not None:
            self.lockstep.leave(self.name)
        with self._lock:
            self._stopped = True
            handles = list(self._handles.values())
            self._handles.clear()
        if self.on_failure is not None:
            self.on_failure(self, handles)
            return
        for h in handles:
            h.link_steps()
            h.updates.put(TokenUpdate((), "abort"))


def continuation(old: Req) -> Req:
    """A fresh request that carries on ``old`` on another scheduler: prompt, sampling and seed as
    before, the tokens already delivered as outputs to recompute (placeholders of lost steps dropped)."""
    known = old.num_known - len(old.prompt_ids)
    return Req(rid=old.rid, prompt_ids=old.prompt_ids, sampling=old.sampling, seed=old.seed,
               output_ids=old.output_ids[:known], num_retractions=old.num_retractions + 1,
               num_cached_prompt_tokens=old.num_cached_prompt_tokens,
               output_logprobs=old.output_logprobs[:known], output_top_logprobs=old.output_top_logprobs[:known])
