"""``RankLoop``: one DP rank at the router — a scheduler driven by the step loop on its own thread.

Other threads reach it through ``submit``/``resume``/``abort`` (an inbox under a small lock; the
scheduler is touched by the loop thread alone) and read what it publishes after each step
(``snapshot``). Token updates go to each request's queue, through the event loop when ``post`` is
given (one call per step for all its requests).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

from ...engine.forward_batch import ForwardBatch, ForwardResult
from ...engine.scheduler.scheduled_step import ScheduledStep
from ...engine.scheduler.scheduler import Scheduler
from ...engine.step_loop import Executor, StepLoop
from ..telemetry.metrics import RankSample
from .prefix_index import PrefixIndex
from .rank_policy import StepPolicy
from .request_handle import Post, RequestHandle, TokenUpdate, continuation, send_updates

if TYPE_CHECKING:
    from ...engine.request import Req
    from ..telemetry.span_record import SpanRecord
    from ..telemetry.step_tracing import RequestTrace, StepTracer

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class RankSnapshot:
    """A rank's state after its last step (read without any lock): what /metrics scrapes (queue,
    running, KV use), and what dispatch weighs: the prompt + generated tokens of the requests queued
    or running, and the prompt tokens served from the prefix cache so far."""

    sample: RankSample
    load_tokens: int = 0
    prefix_hit_tokens: int = 0


@dataclass(frozen=True)
class RankStep:
    scheduled: ScheduledStep
    batch: ForwardBatch  # the scheduled batch, with the step span's context when the engine is remote
    span: SpanRecord | None


class RankLoop:
    def __init__(self, name: str, scheduler: Scheduler, executor: Executor, policy: StepPolicy, *,
                 max_queued_requests: int = 1024, tracer: StepTracer | None = None, post: Post | None = None,
                 on_failure: Callable[[RankLoop, list[RequestHandle]], None] | None = None,
                 close: Callable[[], None] | None = None) -> None:
        self.name, self.scheduler, self.policy = name, scheduler, policy
        self.max_queued_requests = max_queued_requests
        self.tracer, self.post, self.on_failure, self._close = tracer, post, on_failure, close
        self.error: str | None = None
        self.snapshot = RankSnapshot(RankSample(name, scheduler.stats))
        self.prefix = PrefixIndex(scheduler.kv.page_size, scheduler.kv.pool.num_total_pages)
        self._lock = threading.Lock()  # guards the inbox and the handles
        self._inbox: list[RequestHandle | str] = []  # a request to add, or the id of one to abort
        self._inbox_tokens = 0
        self._handles: dict[str, RequestHandle] = {}
        self._step_reqs: tuple[Req, ...] = ()  # the last traced step's requests, and their traces
        self._step_traces: list[RequestTrace] = []
        self._wake = threading.Event()
        self._stopped = False
        # a split prefill slice's result is read when done (the executors match results to steps)
        self._steps = StepLoop(self, executor, policy.max_in_flight, scheduler.stats, ForwardBatch.is_slice)
        self._thread = threading.Thread(target=self._run, name=f"rank-{name}", daemon=True)

    # ---- any thread -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, handle: RequestHandle) -> None:
        """``QueueFullError`` past ``max_queued_requests``; ``ValueError`` for a request id in flight."""
        self._adopt(handle, check_capacity=True)

    def resume(self, handle: RequestHandle) -> None:
        """Continue another rank's request here: its delivered tokens are recomputed (like a
        preempted request), then generation goes on into the same handle; nothing is sent twice."""
        handle.req = continuation(handle.req)
        self._adopt(handle, check_capacity=False)

    def _adopt(self, handle: RequestHandle, check_capacity: bool) -> None:
        req = handle.req
        with self._lock:
            if self._stopped:
                raise QueueFullError(f"engine {self.name} is stopped")
            if check_capacity and len(self._handles) >= self.max_queued_requests:
                raise QueueFullError(f"{len(self._handles)} requests in flight (max {self.max_queued_requests})")
            if req.rid in self._handles:
                raise ValueError(f"request_id {req.rid!r} is already in flight")
            self._handles[req.rid] = handle
            self._inbox.append(handle)
            self._inbox_tokens += req.fill_len
        self.prefix.add(req.prompt_ids)
        self._wake.set()

    def abort(self, rid: str) -> None:
        with self._lock:
            self._inbox.append(rid)
        self._wake.set()

    @property
    def num_requests(self) -> int:
        return len(self._handles)

    @property
    def load_tokens(self) -> int:
        """The last step's load plus the requests submitted since."""
        return self.snapshot.load_tokens + self._inbox_tokens

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def rank_sample(self, rank: str) -> RankSample:
        return replace(self.snapshot.sample, rank=rank)

    def stop(self) -> None:
        """Finish the steps in flight, then end the thread and the executor."""
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        self.policy.leave()
        if self._close is not None:
            self._close()

    def evict(self) -> list[RequestHandle]:
        """Stop this rank and hand over what it still had (to resume elsewhere)."""
        self.stop()
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        return handles

    # ---- the loop thread: the step loop's source ------------------------------------------------
    def _run(self) -> None:
        try:
            self._steps.run(lambda: self._stopped)
        except Exception as exc:  # the engine is gone: its requests continue elsewhere, or end
            logger.exception("rank %s failed: %s", self.name, exc)
            self._fail(f"{type(exc).__name__}: {exc}")

    def _wait(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _drain_inbox(self) -> None:
        with self._lock:
            items, self._inbox, self._inbox_tokens = self._inbox, [], 0
        aborted = []
        for item in items:
            if not isinstance(item, str):
                self.scheduler.add_request(item.req)
            elif (req := self.scheduler.abort(item)) is not None:
                aborted.append((req.rid, TokenUpdate((), "abort")))
        if aborted:
            self._deliver(aborted)

    def next_step(self, idle: bool) -> RankStep | None:
        if self._inbox:
            self._drain_inbox()
        scheduled = self.policy.next_step(self.scheduler, idle, self._wait)
        if scheduled is None:
            return None
        if self.tracer is None or not scheduled.reqs:
            return RankStep(scheduled, scheduled.batch, None)
        if scheduled.reqs != self._step_reqs:  # a steady decode runs the same requests step after step
            self._step_reqs, handles = scheduled.reqs, self._handles
            self._step_traces = [h.trace for h in map(handles.get, [r.rid for r in scheduled.reqs]) if h and h.trace]
        batch, span = self.tracer.start(scheduled.batch, self._step_traces)
        return RankStep(scheduled, batch, span)

    def process(self, step: RankStep, result: ForwardResult) -> None:
        if self.tracer is not None:
            self.tracer.end(step.span, result)
        updates = []
        for ev in self.scheduler.process_result(step.scheduled, result):
            req = ev.req
            n = len(ev.new_token_ids)  # a verify step's run has several: each its logprob
            lp = tuple(req.output_logprobs[-n:]) if req.output_logprobs and n else ()
            top = tuple(map(tuple, req.output_top_logprobs[-n:])) if req.output_top_logprobs and n else ()
            updates.append((req.rid, TokenUpdate(ev.new_token_ids, req.finish_reason if ev.finished else None,
                                                 lp, top)))
        self._deliver(updates)
        self._publish()

    def _deliver(self, updates: Sequence[tuple[str, TokenUpdate]]) -> None:
        items = []
        with self._lock:
            for rid, update in updates:
                handle = self._handles.get(rid)
                if handle is None:
                    continue
                if update.finish_reason is not None:
                    del self._handles[rid]
                items.append((handle, update))
        send_updates(self.post, items)

    def _publish(self) -> None:
        sched = self.scheduler
        kv = sched.kv
        idle_pages = kv.pool.num_free_pages + (kv.cache.num_evictable_pages if kv.cache is not None else 0)
        sample = RankSample(self.name, sched.stats, queued=len(sched.waiting), running=len(sched.running),
                            kv_usage=1.0 - idle_pages / max(kv.pool.num_total_pages, 1))
        self.snapshot = RankSnapshot(
            sample, load_tokens=sum(r.fill_len for r in sched.waiting) + sum(r.fill_len for r in sched.running),
            prefix_hit_tokens=sched.stats.num_prefix_hit_tokens)

    def _fail(self, error: str) -> None:
        self.error = error
        self.policy.leave()
        with self._lock:
            self._stopped = True
            handles = list(self._handles.values())
            self._handles.clear()
        if self.on_failure is not None:
            self.on_failure(self, handles)
            return
        send_updates(self.post, [(h, TokenUpdate((), "abort")) for h in handles])
