"""What every modeserve gRPC server has: health (liveness ``""`` + readiness per service),
reflection, and a graceful SIGTERM (NOT_SERVING -> stop accepting -> finish in flight -> exit)."""

from __future__ import annotations

import gc
import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 2**20


def grpc_address(host: str, port: int) -> str:
    if not 0 <= port < 65536:
        raise ValueError(f"--port must be in [0, 65536), got {port}")
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass
class GrpcServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: tuple[str, ...]
    metrics_port: int | None = None  # the process's Prometheus /metrics port, when serving one

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            self.health.set(name, status)

    def shutdown(self, grace: float) -> threading.Event:
        """Report NOT_SERVING, refuse new RPCs, let in-flight ones finish within ``grace`` seconds."""
        self.set_serving(False)
        return self.server.stop(grace)


def create_grpc_server(
    address: str,
    register: Sequence[Callable[[grpc.Server], None]],
    service_names: Sequence[str],
    max_workers: int = 256,
) -> GrpcServer:
    """Build and start a server on ``address`` (``host:0`` picks a free port) with health and reflection."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
    )
    for add in register:
        add(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise ValueError(f"cannot bind gRPC server to {address!r}")
    server.start()
    out = GrpcServer(server, port, health_servicer, tuple(service_names))
    out.set_serving(True)
    return out


def freeze_startup_heap() -> None:
    """Collect once, then put everything alive after start-up (torch, the model's modules, the
    tokenizer) out of the collector's reach: a full collection while serving then walks only what
    serving allocated, instead of pausing every in-flight stream for the whole heap."""
    gc.collect()
    gc.freeze()


def wait_for_signal(grace: float, stop: threading.Event | None = None) -> None:
    """Block until SIGTERM/SIGINT, or until ``stop`` is set (the heap of start-up frozen first)."""
    freeze_startup_heap()
    signalled = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        logger.info("signal %d: draining (grace %.0fs)", signum, grace)
        signalled.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    # Python runs signal handlers in the main thread, but the kernel may deliver SIGTERM to any thread
    # (gRPC's, torch's); a main thread blocked in an untimed wait is then never woken to run the
    # handler and the process ignores SIGTERM. A timed wait returns to the interpreter, which runs it.
    while not signalled.wait(timeout=0.2) and not (stop is not None and stop.is_set()):
        pass


def serve_until_signal(srv: GrpcServer, grace: float) -> int:
    """Block until SIGTERM/SIGINT, then shut down gracefully; returns the process exit code (0)."""
    wait_for_signal(grace)
    srv.shutdown(grace).wait()
    return 0
