"""The step loop's executor for a remote engine: one bidirectional ``Engine.Forward`` stream.

Batches go out in launch order and results come back in the same order, so a step's pending result
is simply the stream's next message.
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


class _NextResult:
    def __init__(self, responses: Iterator[forward_pb2.ForwardResult]) -> None:
        self._responses = responses

    def result(self) -> ForwardResult:
        try:
            return result_from_proto(next(self._responses))
        except grpc.RpcError as exc:
            raise TransportError(f"engine stream failed: {exc.code().name}: {exc.details()}") from exc
        except StopIteration as exc:
            raise TransportError("engine closed the stream") from exc

    def done(self) -> bool:
        return False  # unknown until the stream's next message is read


class GrpcExecutor:
    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.SimpleQueue[forward_pb2.ForwardBatch | None] = queue.SimpleQueue()
        self._responses = engine_pb2_grpc.EngineStub(channel).Forward(self._request_iter())
        self._next = _NextResult(self._responses)

    def _request_iter(self) -> Iterator[forward_pb2.ForwardBatch]:
        while (msg := self._requests.get()) is not None:
            yield msg

    def launch(self, batch: ForwardBatch) -> _NextResult:
        self._requests.put(batch_to_proto(batch))
        return self._next

    def close(self) -> None:
        self._requests.put(None)
        self._responses.cancel()
