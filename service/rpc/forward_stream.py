"""One ``Engine.Forward`` stream as the step loop's source: batches from the router in, results out in
step order. The stream's RPC lives on the server's event loop; its steps run on a thread of their own
(the step loop blocks on the device). A batch that has arrived is launched before the previous step's
result is awaited, so the device runs step N while step N+1 is unpacked, uploaded and planned."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable

import grpc

from ...engine.forward_batch import ForwardBatch, ForwardResult
from ...engine.scheduler.stats import ForwardModeStats
from ...engine.step_loop import Executor, PendingStep, StepLoop
from ...proto.v1 import forward_pb2
from ..telemetry.step_tracing import end_forward_span, forward_span
from ..telemetry.tracing import Tracing
from .batch_checks import BatchLimits
from .convert import batch_from_proto, result_to_proto

if TYPE_CHECKING:
    from ..telemetry.span_record import SpanRecord

logger = logging.getLogger(__name__)


class StepError(Exception):
    """Ends one stream with a status; the engine keeps serving the others."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class EngineStep:
    batch: ForwardBatch
    span: SpanRecord | None


class _Failed:
    """A launch that raised: its error surfaces when its result is due, after the earlier steps'."""

    def __init__(self, error: StepError) -> None:
        self.error = error

    def result(self) -> ForwardResult:
        raise self.error

    def done(self) -> bool:
        return True


class SharedRunner:
    """The one model runner of the engine behind every stream: launches one at a time; a bad batch
    or a failed forward becomes that step's ``StepError``."""

    def __init__(self, runner: Executor) -> None:
        self._runner = runner
        self._lock = threading.Lock()

    def launch(self, batch: ForwardBatch) -> PendingStep:
        with self._lock:
            try:
                return self._runner.launch(batch)
            except ValueError as exc:  # e.g. a known forward mode this build does not implement
                return _Failed(StepError(grpc.StatusCode.INVALID_ARGUMENT, f"ForwardBatch step {batch.step}: {exc}"))
            except Exception as exc:  # a device or model failure: end this stream, keep serving
                logger.exception("forward of step %d failed", batch.step)
                return _Failed(StepError(grpc.StatusCode.INTERNAL,
                                         f"ForwardBatch step {batch.step}: forward failed: {exc!r}"))


class ForwardStream:
    def __init__(self, limits: BatchLimits, tracing: Tracing, dp_rank: int, stats: ForwardModeStats,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.limits = limits
        self.tracing = tracing
        self.dp_rank = dp_rank
        self.stats = stats
        self.ended = False
        self._error: StepError | None = None  # a batch that could not be read: the stream's last word
        self._inbox: queue.Queue[forward_pb2.ForwardBatch | None] = queue.Queue()
        self._loop = loop
        self.results: asyncio.Queue[forward_pb2.ForwardResult | StepError | None] = asyncio.Queue()

    async def read(self, requests: AsyncIterator[forward_pb2.ForwardBatch]) -> None:
        """The stream's messages into the inbox (on the loop); None marks its end (closed, cancelled or
        broken)."""
        try:
            async for msg in requests:
                self._inbox.put(msg)
        except Exception:  # the RPC ended under us (cancelled, deadline): the stream is over either way
            pass
        finally:
            self._inbox.put(None)

    def _post(self, item: forward_pb2.ForwardResult | StepError | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self.results.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server stopped, nobody waits for results
            pass

    def run(self, executor: Executor, defer: Callable[[ForwardBatch], bool] | None = None) -> None:
        """Step (on the calling thread) until the router closes the stream or a step fails; the results
        (then an error, if any, then None) go to ``results``, in step order but for the ``defer``red
        steps' (``StepLoop``)."""
        try:
            StepLoop(self, executor, 2, self.stats, defer).run(lambda: self.ended)
        except StepError as exc:
            self._error = exc
        if self._error is not None:
            self._post(self._error)
        self._post(None)

    def next_step(self, idle: bool) -> EngineStep | None:
        try:
            msg = self._inbox.get(block=idle, timeout=0.5 if idle else None)
        except queue.Empty:
            return None
        if msg is None:
            self.ended = True
            return None
        try:
            batch = batch_from_proto(msg, self.limits)
        except ValueError as exc:  # the steps in flight still finish, then the stream ends with this
            self.ended = True
            self._error = StepError(grpc.StatusCode.INVALID_ARGUMENT, f"ForwardBatch step {msg.step}: {exc}")
            return None
        return EngineStep(batch, forward_span(self.tracing, batch, self.dp_rank) if self.tracing.enabled else None)

    def process(self, step: EngineStep, result: ForwardResult) -> None:
        end_forward_span(self.tracing, step.span, result)
        batch = step.batch
        self.stats.record(batch.forward_mode, batch.batch_size, batch.num_tokens)
        self._post(result_to_proto(result, batch.step))
