"""Assemble a router: rank loops (in-process or remote) + the Generate and Admin services on one
asyncio gRPC server."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ...proto.v1 import admin_pb2_grpc, generate_pb2_grpc
from ..rpc.grpc_server import EventLoopThread, GrpcServer
from ..rpc.grpc_server import wait_for_signal
from ..telemetry.metrics import MetricsServer
from ..telemetry.tracing import Tracing
from .admin_servicer import ADMIN_SERVICE, AdminServicer
from .generate_servicer import GENERATE_SERVICE, GenerateServicer
from .rank_loop import RankLoop
from .rank_table import RankTable
from .request_validation import RequestParser


@dataclass
class RouterApp:
    events: EventLoopThread
    server: GrpcServer
    servicer: GenerateServicer
    table: RankTable
    metrics: MetricsServer
    tracing: Tracing
    on_stop: list[Callable[[], None]] = field(default_factory=list)  # first thing stop() does (rank sources)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def loops(self) -> list[RankLoop]:
        return self.table.all_loops()

    def stop(self, grace: float = 5.0) -> None:
        """Refuse new calls, let the streams finish within ``grace``, then stop the ranks."""
        for stop in self.on_stop:
            stop()
        self.server.shutdown(grace)
        self.table.close()
        self.events.close()
        self.metrics.stop()
        self.tracing.shutdown()


def serve_app(app: RouterApp, label: str, host: str, grace: float, stop: threading.Event | None = None) -> int:
    """Announce the bound port (tests and scripts read this line), serve until SIGTERM (or ``stop``
    is set), drain."""
    print(f"modeserve {label} listening on {host}:{app.port}", flush=True)
    wait_for_signal(grace, stop)
    app.stop(grace)
    return 0


def start_router(address: str, events: EventLoopThread, table: RankTable, parser: RequestParser, model_name: str,
                 eos_token_ids: Sequence[int], metrics_port: int | None = None,
                 tracing: Tracing | None = None) -> RouterApp:
    """Serve Generate (and Admin, over the same table) on ``address``; /metrics on ``metrics_port``."""
    metrics = MetricsServer(table.samples, router=True)
    if metrics_port is not None:
        metrics.start(metrics_port)
    tracing = tracing or Tracing("router")
    servicer = GenerateServicer(parser, table, model_name, eos_token_ids, metrics.requests, tracing)
    admin = AdminServicer(table)
    server = GrpcServer(events, address,
                       [lambda s: generate_pb2_grpc.add_GenerateServicer_to_server(servicer, s),
                        lambda s: admin_pb2_grpc.add_AdminServicer_to_server(admin, s)],
                       [GENERATE_SERVICE, ADMIN_SERVICE])
    return RouterApp(events, server, servicer, table, metrics, tracing)
