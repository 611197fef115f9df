"""The step loop's executor for a remote engine: one bidirectional ``Engine.Forward`` stream.

Batches go out in launch order; results come back in that order, except that an engine may send a
split prefill slice's after later steps' (it ran beside them), so a result is matched by its step.
"""

from __future__ import annotations

import queue
from typing import Iterator

import grpc

from ...engine.forward_batch import ForwardBatch, ForwardResult
from ...proto.v1 import engine_pb2_grpc, forward_pb2
from .convert import batch_to_proto, result_from_proto


class TransportError(RuntimeError):
    """The engine is unreachable or refused a batch; the stream is unusable afterwards."""


class _Results:
    """The stream's results by step: one read while another step's was awaited waits here for its own."""

    def __init__(self, responses: Iterator[forward_pb2.ForwardResult]) -> None:
        self._responses = responses
        self._early: dict[int, ForwardResult] = {}

    def take(self, step: int) -> ForwardResult:
        while step not in self._early:
            try:
                msg = next(self._responses)
            except grpc.RpcError as exc:
                raise TransportError(f"engine stream failed: {exc.code().name}: {exc.details()}") from exc
            except StopIteration as exc:
                raise TransportError("engine closed the stream") from exc
            self._early[msg.step] = result_from_proto(msg)
        return self._early.pop(step)

    def has(self, step: int) -> bool:
        return step in self._early


class _StepResult:
    def __init__(self, results: _Results, step: int) -> None:
        self._results, self._step = results, step

    def result(self) -> ForwardResult:
        return self._results.take(self._step)

    def done(self) -> bool:
        return self._results.has(self._step)  # read already (the stream is read only when a result is due)


class GrpcExecutor:
    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.SimpleQueue[forward_pb2.ForwardBatch | None] = queue.SimpleQueue()
        self._responses = engine_pb2_grpc.EngineStub(channel).Forward(self._request_iter())
        self._results = _Results(self._responses)

    def _request_iter(self) -> Iterator[forward_pb2.ForwardBatch]:
        while (msg := self._requests.get()) is not None:
            yield msg

    def launch(self, batch: ForwardBatch) -> _StepResult:
        self._requests.put(batch_to_proto(batch))
        return _StepResult(self._results, batch.step)

    def close(self) -> None:
        self._requests.put(None)
        self._responses.cancel()
