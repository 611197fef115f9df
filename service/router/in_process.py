"""``modeserve serve``'s router: one rank whose executor is the model runner in this process."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ...engine.llm import LLM
from ..rpc.grpc_server import EventLoopThread, ServerOptions
from ..rpc.tls import TlsFiles
from ..telemetry.step_tracing import StepTracer
from ..telemetry.tracing import Tracing
from .app import HttpAddress, RouterApp, start_router
from .dispatch import Dispatcher
from .rank_loop import RankLoop
from .rank_policy import FreeRunning
from .rank_table import RankSpec, RankTable
from .request_handle import RequestHandle
from .request_validation import RequestParser


def start_serve(address: str, model: str | None, overlap: bool = True, max_queued_requests: int = 1024,
                max_new_tokens_limit: int | None = None, metrics_port: int | None = None,
                tracing: Tracing | None = None, http: HttpAddress | None = None, api_key: str | None = None,
                tls: TlsFiles | None = None, options: ServerOptions = ServerOptions(),
                **engine_kwargs: Any) -> RouterApp:
    """One process: router + scheduler + engine, the model runner as the rank's executor."""
    llm = LLM(model=model, **engine_kwargs)
    tracing = tracing or Tracing("router", dp_rank=0)
    events = EventLoopThread()
    tracer = StepTracer(tracing, 0, in_process=True) if tracing.enabled else None

    def connect(rank: int, address: str, on_failure: Callable[[RankLoop, list[RequestHandle]], None]) -> RankLoop:
        loop = RankLoop(f"rank{rank}", llm.scheduler, llm.runner, FreeRunning(2 if overlap else 1),
                        max_queued_requests=max_queued_requests, tracer=tracer, post=events.post,
                        on_failure=on_failure)
        loop.start()
        return loop

    table = RankTable(connect, Dispatcher(), post=events.post)
    table.set_ranks([RankSpec(0, "in-process")])
    table.wait_ready(60)
    limits = dataclasses.replace(llm.scheduler.limits, max_new_tokens=max_new_tokens_limit or llm.runner.max_context)
    parser = RequestParser(llm.tokenizer, limits, llm.config.scheduler.random_seed)
    eos = llm.scheduler.stop.eos_token_ids
    return start_router(address, events, table, parser, llm.model_config.name, sorted(eos), metrics_port, tracing,
                        http, api_key, tls, options)
