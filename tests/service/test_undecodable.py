"""Request bytes that do not parse are INVALID_ARGUMENT on a modeserve gRPC server, whatever the
method's shape (grpc-python's aio server alone answers UNKNOWN): health's Check (one request, one
answer), Watch (one request, a stream, written with ``context.write``) and reflection (a stream of
requests); the same methods with valid requests are served as before."""

from __future__ import annotations

from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from modeserve.service.rpc.grpc_server import EventLoopThread, GrpcServer

GARBAGE = b"\xff\xff\xff"  # a truncated varint: no message parses from it


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    loop = EventLoopThread()
    server = GrpcServer(loop, "127.0.0.1:0", [], ["test.Service"])
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch
    server.shutdown(0)
    loop.close()


@pytest.mark.parametrize("call", [
    lambda ch: ch.unary_unary("/grpc.health.v1.Health/Check")(GARBAGE, timeout=5),
    lambda ch: list(ch.unary_stream("/grpc.health.v1.Health/Watch")(GARBAGE, timeout=5)),
    lambda ch: list(ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(
        iter([GARBAGE]), timeout=5)),
], ids=["unary", "server-streaming", "bidi-streaming"])
def test_undecodable_requests_are_invalid_argument(channel: grpc.Channel, call: object) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call(channel)  # type: ignore[operator]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in (err.value.details() or "")


def test_valid_requests_are_served_as_before(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="test.Service"), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=5)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for s in next(replies).list_services_response.service}
    assert {"test.Service", "grpc.health.v1.Health"} <= names
