"""Assemble a router: engine loops (in-process or remote) + the Generate service on one server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ...engine.tokenizer import Tokenizer
from ...proto.v1 import admin_pb2_grpc, generate_pb2_grpc
from .admin_servicer import ADMIN_SERVICE, AdminServicer
from .dispatch import Dispatcher
from .rank_loop import EngineLoop, RequestHandle
from ..rpc.grpc_server import GrpcServer, create_grpc_server
from ..telemetry.metrics import MetricsServer
from ..telemetry.tracing import Tracing
from .rank_table import RankSpec, RankTable
from .request_validation import RequestLimits
from .generate_servicer import GENERATE_SERVICE, GenerateServicer


@dataclass
class RouterApp:
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
    def loops(self) -> list[EngineLoop]:
        return self.table.all_loops()

    def stop(self, grace: float = 5.0) -> None:
        for stop in self.on_stop:
            stop()
        self.server.shutdown(grace).wait()
        self.table.close()
        self.metrics.stop()
        self.tracing.shutdown()


def serve_app(app: RouterApp, label: str, host: str, grace: float) -> int:
    """Announce the bound port (tests and scripts read this line), serve until SIGTERM, drain."""
    from ..rpc.grpc_server import serve_until_signal

    print(f"modeserve {label} listening on {host}:{app.port}", flush=True)
    code = serve_until_signal(app.server, grace)
    for stop in app.on_stop:
        stop()
    app.table.close()
    app.tracing.shutdown()
    return code


def start_router(address: str, table: RankTable, tokenizer: Tokenizer | None, limits: RequestLimits,
                 model_name: str, eos_token_ids: Sequence[int], metrics_port: int | None = None,
                 tracing: Tracing | None = None) -> RouterApp:
    """Serve Generate (and Admin, over the same table) on ``address``; /metrics on ``metrics_port``."""
    metrics = MetricsServer(table.samples, router=True)
    if metrics_port is not None:
        metrics.start(metrics_port)
    tracing = tracing or Tracing("router")
    servicer = GenerateServicer(tokenizer, table, limits, model_name, eos_token_ids, metrics.requests, tracing)
    admin = AdminServicer(table)
    server = create_grpc_server(
        address,
        [lambda s: generate_pb2_grpc.add_GenerateServicer_to_server(servicer, s),
         lambda s: admin_pb2_grpc.add_AdminServicer_to_server(admin, s)],
        [GENERATE_SERVICE, ADMIN_SERVICE],
    )
    return RouterApp(server, servicer, table, metrics, tracing)


def start_serve(address: str, model: str | None, overlap: bool = True, max_queued_requests: int = 1024,
                max_new_tokens_limit: int | None = None, metrics_port: int | None = None,
                tracing: Tracing | None = None, **engine_kwargs: object) -> RouterApp:
    """One process: router + scheduler + engine with the in-process transport."""
    from ...engine.llm import LLM
    from ..rpc.transport import InProcessTransport

    llm = LLM(model=model, **engine_kwargs)
    tracing = tracing or Tracing("router", dp_rank=0)

    def connect(rank: int, address: str, on_failure: Callable[[EngineLoop, list[RequestHandle]], None]) -> EngineLoop:
        loop = EngineLoop(llm.scheduler, InProcessTransport(llm.runner), overlap=overlap,
                          max_queued_requests=max_queued_requests, name=f"rank{rank}", on_failure=on_failure,
                          tracing=tracing, dp_rank=rank)
        loop.start()
        return loop

    table = RankTable(connect, Dispatcher())
    table.set_ranks([RankSpec(0, "in-process")])
    table.wait_ready(60)
    limits = RequestLimits(
        max_context=llm.runner.max_context,
        vocab_size=llm.model_config.vocab_size,
        max_new_tokens=max_new_tokens_limit or llm.runner.max_context,
        max_prompt_chars=64 * llm.runner.max_context,
    )
    eos = llm.scheduler.stop.eos_token_ids
    return start_router(address, table, llm.tokenizer, limits, llm.model_config.name, sorted(eos), metrics_port,
                        tracing)
