"""Assemble a router: rank loops (in-process or remote) + the Generate and Admin services on one
asyncio gRPC server, or Admin on a port of its own (``admin_port``): SetRanks decides where every
prompt goes, so under TLS with a CA that port serves only clients with a certificate the CA signed
(the operator), while Generate's clients need none."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from ...proto.v1 import admin_pb2_grpc, generate_pb2_grpc
from ..rpc.grpc_server import EventLoopThread, GrpcServer, ServerOptions
from ..rpc.grpc_server import wait_for_signal
from ..rpc.tls import ReloadingServerCredentials, TlsFiles
from ..telemetry.metrics import MetricsServer
from ..telemetry.tracing import Tracing
from .admin_servicer import ADMIN_SERVICE, AdminServicer
from .backlog import Backlog
from .api_key import ApiKeyInterceptor
from .generate_servicer import GENERATE_SERVICE, GenerateServicer
from .generation import Generation
from .rank_loop import RankLoop
from .rank_table import RankTable
from .request_validation import RequestParser

if TYPE_CHECKING:  # FastAPI and uvicorn are imported only when the HTTP API is on
    from ..http.server import HttpServer


class HttpAddress(NamedTuple):
    host: str
    port: int


@dataclass
class RouterApp:
    events: EventLoopThread
    server: GrpcServer
    servicer: GenerateServicer
    table: RankTable
    metrics: MetricsServer
    tracing: Tracing
    http: HttpServer | None = None
    admin: GrpcServer | None = None  # Admin's own server (None: on ``server``)
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
        self.servicer.generation.draining = True  # /health says so; new HTTP requests get 503
        if self.http is not None:
            self.http.shutdown(grace, wait=False)
        self.server.shutdown(grace)
        if self.admin is not None:
            self.admin.shutdown(0)
        if self.http is not None:
            self.http.shutdown(grace)
        self.table.close()
        self.events.close()
        self.metrics.stop()
        self.tracing.shutdown()


def serve_app(app: RouterApp, label: str, host: str, grace: float, stop: threading.Event | None = None) -> int:
    """Announce the bound ports (gRPC first; ``rpc/engine_process.read_addresses`` reads them), serve
    until SIGTERM (or ``stop`` is set), drain."""

    def announce() -> None:
        print(f"modeserve {label} listening on {host}:{app.port}", flush=True)
        if app.http is not None:
            print(f"modeserve {label} HTTP API on {host}:{app.http.port}", flush=True)
        if app.metrics.port is not None:
            print(f"modeserve {label} metrics on {app.metrics.host}:{app.metrics.port}", flush=True)

    wait_for_signal(grace, stop, announce)
    app.stop(grace)
    return 0


def start_router(address: str, events: EventLoopThread, table: RankTable, parser: RequestParser, model_name: str,
                 eos_token_ids: Sequence[int], metrics_port: int | None = None,
                 tracing: Tracing | None = None, http: HttpAddress | None = None,
                 api_key: str | None = None, tls: TlsFiles | None = None,
                 options: ServerOptions = ServerOptions(), admin_port: int | None = None) -> RouterApp:
    """Serve Generate (and Admin, over the same table, unless ``admin_port``) on ``address``, the
    OpenAI HTTP API on ``http`` (both asking for ``api_key`` if given, both over TLS with ``tls``);
    /metrics on ``metrics_port``; Admin on ``admin_port`` (mutual TLS when ``tls`` has a CA)."""
    credentials = ReloadingServerCredentials(tls, require_client_cert=False).credentials if tls else None
    metrics = MetricsServer(table.samples, router=True)
    if metrics_port is not None:
        metrics.start(metrics_port)
    tracing = tracing or Tracing("router")
    generation = Generation(parser, table, model_name, metrics.requests, tracing, Backlog(options.max_unsent_tokens))
    servicer = GenerateServicer(generation, eos_token_ids)
    admin = AdminServicer(table)
    register_admin = lambda s: admin_pb2_grpc.add_AdminServicer_to_server(admin, s)  # noqa: E731
    services = [GENERATE_SERVICE] + ([ADMIN_SERVICE] if admin_port is None else [])
    server = GrpcServer(events, address,
                       [lambda s: generate_pb2_grpc.add_GenerateServicer_to_server(servicer, s),
                        *([register_admin] if admin_port is None else [])],
                       services, [ApiKeyInterceptor(api_key)] if api_key else [], credentials, options)
    app = RouterApp(events, server, servicer, table, metrics, tracing)
    try:
        if admin_port is not None:
            mutual = tls is not None and tls.ca is not None
            admin_credentials = ReloadingServerCredentials(tls, mutual).credentials if tls else None
            app.admin = GrpcServer(events, f"{address.rsplit(':', 1)[0]}:{admin_port}", [register_admin],
                                   [ADMIN_SERVICE], credentials=admin_credentials,
                                   options=ServerOptions(reflection=options.reflection))
        if http is not None:
            from ..http.routes import create_app
            from ..http.server import HttpServer

            app.http = HttpServer(events, create_app(generation, api_key), http.host, http.port, tls)
    except BaseException:
        app.stop(0)
        raise
    return app
