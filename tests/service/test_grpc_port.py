"""A modeserve gRPC server owns its port: a second server asking for it is refused (gRPC core would
otherwise bind it too, through SO_REUSEPORT, and split the connections between the two), and once the
first has shut down the port binds again (an engine restarted at its address)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modeserve.service.rpc.grpc_server import EventLoopThread, GrpcServer, ServerOptions


def serving(port: int, service: str) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_taken_port_is_refused_and_binds_again_once_free() -> None:
    loop = EventLoopThread()
    try:
        first = GrpcServer(loop, "127.0.0.1:0", [], ["first.Service"])
        with pytest.raises(ValueError, match="cannot bind"):
            GrpcServer(loop, f"127.0.0.1:{first.port}", [], ["second.Service"])
        assert serving(first.port, "first.Service")  # every connection still reaches the first
        first.shutdown(0)
        again = GrpcServer(loop, f"127.0.0.1:{first.port}", [], ["second.Service"])
        assert again.port == first.port and serving(again.port, "second.Service")
        again.shutdown(0)
    finally:
        loop.close()


def test_a_taken_health_port_is_refused() -> None:
    loop = EventLoopThread()
    try:
        first = GrpcServer(loop, "127.0.0.1:0", [], ["first.Service"], options=ServerOptions(health_port=0))
        assert first.health_port is not None and serving(first.health_port, "first.Service")
        with pytest.raises(ValueError, match="health port"):
            GrpcServer(loop, "127.0.0.1:0", [], ["second.Service"], options=ServerOptions(health_port=first.health_port))
        first.shutdown(0)
    finally:
        loop.close()
