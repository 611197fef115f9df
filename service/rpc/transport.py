"""How a scheduler reaches its engine: submit batches in step order, receive results in order.

Two implementations with the same contract: in-process (a worker thread calling the model runner
with the same message objects) and gRPC (one ``Engine.Forward`` stream).
"""

from __future__ import annotations

import abc
import collections
import functools
import queue
import threading
from typing import Callable, Iterator

import grpc

from ...engine.forward_batch import ForwardBatch, ForwardResult


class TransportError(RuntimeError):
    """The engine is unreachable or refused a batch; the transport is unusable afterwards."""


class EngineTransport(abc.ABC):
    in_process = False  # the engine runs in this process: the scheduler's step span is its forward span

    @abc.abstractmethod
    def submit(self, batch: ForwardBatch) -> None:
        """Queue ``batch``; returns at once (the engine may still be running earlier ones)."""

    @abc.abstractmethod
    def receive(self, timeout: float | None = None) -> ForwardResult:
        """The result of the oldest submitted batch not yet received (``TransportError`` on failure)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


_CLOSE = object()


def _reraise(exc: BaseException) -> ForwardResult:
    raise exc


class InProcessTransport(EngineTransport):
    """Runs batches on a local ``ModelRunner`` in a worker thread (so scheduling overlaps compute)."""

    in_process = True

    def __init__(self, runner: object) -> None:
        self._runner = runner
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[ForwardResult | BaseException] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="engine-inprocess", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        """Launch each batch as it arrives and keep one launched while the next is prepared: the
        device runs step N while the host uploads and plans step N+1."""
        pending: collections.deque[Callable[[], ForwardResult]] = collections.deque()
        closing = False
        while not closing or pending:
            item: object = None
            if not closing:
                try:
                    item = self._inbox.get(block=not pending, timeout=None)
                except queue.Empty:
                    item = None
            if item is _CLOSE:
                closing = True
            elif item is not None:
                pending.append(self._launch(item))  # type: ignore[arg-type]
                if len(pending) < 2:
                    continue
            if pending:
                try:
                    self._results.put(pending.popleft()())
                except BaseException as exc:  # delivered to the scheduler thread
                    self._results.put(exc)

    def _launch(self, batch: ForwardBatch) -> Callable[[], ForwardResult]:
        try:
            pending = self._runner.launch(batch)  # type: ignore[attr-defined]
        except BaseException as exc:
            return functools.partial(_reraise, exc)
        return pending.result  # type: ignore[no-any-return]

    def submit(self, batch: ForwardBatch) -> None:
        self._inbox.put(batch)

    def receive(self, timeout: float | None = None) -> ForwardResult:
        item = self._results.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise TransportError(f"engine failed: {item}") from item
        return item

    def close(self) -> None:
        """Stop the worker and wait for it: a daemon thread still running (or freeing tensors)
        while the interpreter exits aborts the process."""
        self._inbox.put(_CLOSE)
        self._thread.join(timeout=30)


class GrpcTransport(EngineTransport):
    """One bidirectional ``Engine.Forward`` stream over a gRPC channel."""

    def __init__(self, channel: grpc.Channel) -> None:
        from ...proto.v1 import engine_pb2_grpc

        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        stub = engine_pb2_grpc.EngineStub(channel)
        self._responses = stub.Forward(self._request_iter())

    def _request_iter(self) -> Iterator[object]:
        while (msg := self._requests.get()) is not _CLOSE:
            yield msg

    def submit(self, batch: ForwardBatch) -> None:
        from .convert import batch_to_proto

        self._requests.put(batch_to_proto(batch))

    def receive(self, timeout: float | None = None) -> ForwardResult:
        from .convert import result_from_proto

        try:
            return result_from_proto(next(self._responses))
        except grpc.RpcError as exc:
            raise TransportError(f"engine stream failed: {exc.code().name}: {exc.details()}") from exc
        except StopIteration as exc:
            raise TransportError("engine closed the stream") from exc

    def close(self) -> None:
        self._requests.put(_CLOSE)
        self._responses.cancel()
