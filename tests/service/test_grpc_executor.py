"""The remote executor over a real gRPC stream from an engine that answers a step out of order (as one does
for a split prefill's last slice beside the decodes): each pending result is its own step's, and ``done``
tells a result already read from one not yet come."""

from __future__ import annotations

from concurrent import futures
from typing import Iterator

import grpc
import numpy as np

from modeserve.engine.forward_batch import ForwardBatch
from modeserve.proto.v1 import engine_pb2_grpc, forward_pb2
from modeserve.service.rpc.grpc_executor import GrpcExecutor


class _Swapping(engine_pb2_grpc.EngineServicer):
    """Answers each pair of steps second first; a result's only token is its step number."""

    def Forward(self, request_iterator: Iterator[forward_pb2.ForwardBatch],
                context: grpc.ServicerContext) -> Iterator[forward_pb2.ForwardResult]:
        held: forward_pb2.ForwardBatch | None = None
        for batch in request_iterator:
            if held is None:
                held = batch
                continue
            for b in (batch, held):
                yield forward_pb2.ForwardResult(step=b.step, next_token_ids=np.array([b.step], "<i8").tobytes())
            held = None


def test_results_are_matched_to_their_steps() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    engine_pb2_grpc.add_EngineServicer_to_server(_Swapping(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    executor = GrpcExecutor(channel)
    try:
        pending = [executor.launch(ForwardBatch.idle(step)) for step in (1, 2, 3, 4)]
        assert not pending[0].done()  # nothing read yet
        assert pending[0].result().next_token_ids.tolist() == [1]  # read after step 2's
        assert pending[1].done()
        assert pending[1].result().next_token_ids.tolist() == [2]
        assert not pending[2].done()
        assert [p.result().next_token_ids.tolist() for p in pending[2:]] == [[3], [4]]
    finally:
        executor.close()
        channel.close()
        server.stop(0)
