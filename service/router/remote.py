"""``modeserve router``'s assembly: one rank loop per remote engine server (each a scheduler sized by
the engine's description, driving it over one Forward stream), ranks from a list or an EngineSet."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ...engine.config import SchedulerConfig
from ...engine.models.dllm_spec import DllmSpec
from ...engine.request_limits import RequestLimits
from ...engine.scheduler.create import create_scheduler
from ...engine.tokenizer import Tokenizer, load_tokenizer
from ..rpc.grpc_server import EventLoopThread, ServerOptions
from ..rpc.engine_client import describe_engine, engine_healthy
from ..rpc.grpc_executor import GrpcExecutor
from ..rpc.tls import TlsFiles
from ..telemetry.step_tracing import StepTracer
from ..telemetry.tracing import Tracing
from .app import HttpAddress, RouterApp, start_router
from .dispatch import Dispatcher
from .lockstep import LockstepGroup
from .rank_loop import RankLoop
from .rank_policy import FreeRunning, Lockstep, StepPolicy
from .rank_table import RankSpec, RankTable
from .request_handle import RequestHandle
from .request_validation import RequestParser

if TYPE_CHECKING:
    from .engineset_watch import EngineSetWatch

OVERLAP_DEPTH = 3  # steps in flight per remote rank: step N+2 is queued at the engine while N's result travels


@dataclasses.dataclass(frozen=True)
class RemoteRouterConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    overlap: bool = True
    max_queued_requests: int = 1024
    wait: float = 120.0  # seconds to wait for engines to be SERVING
    dispatch: str = "prefix"
    lockstep: bool = False
    health_interval: float = 1.0
    metrics_port: int | None = None
    http: HttpAddress | None = None  # where to serve the OpenAI HTTP API (None: not at all)
    api_key: str | None = None  # what Generate and HTTP calls must carry (None: nothing)
    tls: TlsFiles | None = None  # the router's own servers over TLS (gRPC and HTTP)
    engine_tls: TlsFiles | None = None  # TLS to the engines (its CA verifies them; its certificate is presented)
    server: ServerOptions = ServerOptions()
    admin_port: int | None = None  # Admin on a port of its own (mutual TLS under tls with a CA); None: the main one


def start_remote_router(address: str, engines: list[str], model: str | None, cfg: RemoteRouterConfig,
                        watch: EngineSetWatch | None = None) -> RouterApp:
    """Router over remote engines; rank i is ``engines[i]``. With ``watch`` (not started yet; the
    router starts and stops it), the ranks are its EngineSet's instead: the router waits up to
    ``cfg.wait`` seconds for a table with a rank, then follows every new one. Admin/SetRanks changes
    them too."""
    if watch is None:
        return _start(address, [RankSpec(i, e) for i, e in enumerate(engines)], model, cfg)
    try:
        app = _start(address, watch.start().wait_ranks(cfg.wait), model, cfg, follow=watch.follow)
    except BaseException:
        watch.stop()
        raise
    app.on_stop.append(watch.stop)
    return app


def _start(address: str, initial: list[RankSpec], model: str | None, cfg: RemoteRouterConfig,
           follow: Callable[[Callable[[list[RankSpec]], None]], None] | None = None) -> RouterApp:
    if not initial:
        raise ValueError("router: no engines")
    first = next((s for s in initial if not s.draining), initial[0])
    _, desc = describe_engine(first.address, cfg.wait, cfg.engine_tls)  # the model's facts: tokenizer, limits
    source = model or (desc.model_path if Path(desc.model_path).exists() else None)
    tokenizer: Tokenizer | None = load_tokenizer(source) if source else None
    decode = tokenizer.decode if tokenizer is not None else None
    group = LockstepGroup() if cfg.lockstep else None
    tracing = Tracing("router")
    events = EventLoopThread()

    def connect(rank: int, addr: str, on_failure: Callable[[RankLoop, list[RequestHandle]], None]) -> RankLoop:
        channel, d = describe_engine(addr, cfg.wait, cfg.engine_tls)
        if d.model != desc.model or d.vocab_size != desc.vocab_size:
            raise ValueError(f"engine {addr} serves {d.model!r}, the router serves {desc.model!r}")
        sched_cfg = dataclasses.replace(cfg.scheduler, max_running_requests=min(cfg.scheduler.max_running_requests,
                                                                                d.max_running_requests))
        scheduler = create_scheduler(sched_cfg, num_pages=d.num_kv_slots // d.page_size, page_size=d.page_size,
                              max_context=d.max_context_len, vocab_size=d.vocab_size,
                              eos_token_ids=tuple(d.eos_token_ids), decode=decode, num_layers=d.num_layers,
                              dllm_spec=DllmSpec(d.dllm_block_size, d.dllm_mask_token_id) if d.dllm_block_size else None)
        policy: StepPolicy = (Lockstep(group, addr, list(d.cuda_graph_batch_sizes)) if group is not None
                              else FreeRunning(OVERLAP_DEPTH if cfg.overlap else 1))
        executor = GrpcExecutor(channel)
        tracer = StepTracer(tracing, d.dp_rank, in_process=False) if tracing.enabled else None
        loop = RankLoop(addr, scheduler, executor, policy, max_queued_requests=cfg.max_queued_requests,
                        tracer=tracer, post=events.post, on_failure=on_failure, close=executor.close)
        loop.start()
        return loop

    table = RankTable(connect, Dispatcher(cfg.dispatch), health=functools.partial(engine_healthy, tls=cfg.engine_tls),
                      health_interval=cfg.health_interval,
                      post=events.post)
    table.set_ranks(initial)
    if follow is not None:
        follow(table.set_ranks)
    table.wait_ready(cfg.wait + 30)
    num_slots = desc.num_kv_slots - desc.page_size  # page 0 is reserved
    limits = RequestLimits(max_context=desc.max_context_len, vocab_size=desc.vocab_size, kv_capacity_tokens=num_slots,
                           max_new_tokens=desc.max_context_len, max_prompt_chars=64 * desc.max_context_len)
    parser = RequestParser(tokenizer, limits, cfg.scheduler.random_seed)
    return start_router(address, events, table, parser, desc.model, list(desc.eos_token_ids), cfg.metrics_port,
                        tracing, cfg.http, cfg.api_key, cfg.tls, cfg.server, cfg.admin_port)
