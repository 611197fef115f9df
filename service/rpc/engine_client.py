"""The router's view of an engine server before it streams to it: wait until it serves, ask what it holds,
check its health."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ...proto.v1 import engine_pb2, engine_pb2_grpc
from .grpc_server import MAX_MESSAGE_BYTES
from .tls import TlsFiles, open_channel

ENGINE_SERVICE = "modeserve.v1.Engine"


def wait_serving(channel: grpc.Channel, service: str, timeout: float) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"engine did not report SERVING within {timeout:.0f}s")
        time.sleep(0.2)


def describe_engine(address: str, wait: float,
                    tls: TlsFiles | None = None) -> tuple[grpc.Channel, engine_pb2.EngineDescription]:
    """Open a channel (TLS with ``tls``), wait until the engine is SERVING, and ask what it holds."""
    channel = open_channel(address, tls, [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                          ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    wait_serving(channel, ENGINE_SERVICE, wait)
    return channel, engine_pb2_grpc.EngineStub(channel).Describe(engine_pb2.DescribeRequest(), timeout=10)


def engine_healthy(address: str, timeout: float = 2.0, tls: TlsFiles | None = None) -> bool:
    """One health check of an engine's Engine service."""
    with open_channel(address, tls) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=ENGINE_SERVICE), timeout=timeout).status
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING
