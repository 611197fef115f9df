"""``modeserve router --engines host:port[,...]`` (or ``--engineset NAME`` in Kubernetes): the Generate
service over remote engine servers, one scheduler (and one Forward stream) per engine."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ...engine.config import SchedulerConfig
from ...engine.scheduler.scheduler import Scheduler
from ...engine.tokenizer import Tokenizer, load_tokenizer
from ...proto.v1 import engine_pb2, engine_pb2_grpc
from .engine_args import add_engine_args, engine_kwargs
from ..router.dispatch import POLICIES, Dispatcher
from ..router.rank_loop import EngineLoop, RequestHandle
from ..router.lockstep import LockstepGroup
from ..router.rank_table import RankSpec, RankTable
from ..telemetry.tracing import Tracing
from ..rpc.grpc_server import MAX_MESSAGE_BYTES
from ..router.request_validation import RequestLimits
from ..router.app import RouterApp, start_router
from ..rpc.transport import GrpcTransport

if TYPE_CHECKING:  # the kubernetes client is imported only when the router follows an EngineSet
    from ..router.engineset_watch import EngineSetWatch


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("router", help="serve Generate over remote engine servers")
    ranks = p.add_mutually_exclusive_group(required=True)
    ranks.add_argument("--engines", help="comma-separated host:port of engine servers (rank i: the i-th)")
    ranks.add_argument("--engineset", help="follow this EngineSet's rank table (status.ranks, published by the "
                                           "operator); needs get/list/watch on enginesets")
    p.add_argument("--namespace", default=None,
                   help="the EngineSet's namespace (default: $POD_NAMESPACE, else this pod's service account's)")
    p.add_argument("--model", default=None, help="where to load the tokenizer (default: the engine's model path)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-queued-requests", type=int, default=1024)
    p.add_argument("--grace-period", type=float, default=30.0)
    p.add_argument("--engine-wait", type=float, default=120.0, help="seconds to wait for engines to be SERVING")
    p.add_argument("--dispatch", choices=POLICIES, default="prefix",
                   help="prefix: longest cached prefix (ties and overload by load); least-loaded; round-robin")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--dp-lockstep", action="store_true",
                   help="all ranks step together (IDLE when without work; CUDA-graph steps padded alike)")
    add_engine_args(p, (SchedulerConfig,))
    p.set_defaults(func=run)


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


def describe_engine(address: str, wait: float) -> tuple[grpc.Channel, engine_pb2.EngineDescription]:
    """Open a channel, wait until the engine is SERVING, and ask what it holds."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    wait_serving(channel, "modeserve.v1.Engine", wait)
    return channel, engine_pb2_grpc.EngineStub(channel).Describe(engine_pb2.DescribeRequest(), timeout=10)


def engine_loop(address: str, channel: grpc.Channel, desc: engine_pb2.EngineDescription,
                sched_cfg: SchedulerConfig, overlap: bool, max_queued: int,
                decode: Callable[[list[int]], str] | None = None,
                on_failure: Callable[[EngineLoop, list[RequestHandle]], None] | None = None,
                lockstep: LockstepGroup | None = None, tracing: Tracing | None = None) -> EngineLoop:
    """A scheduler sized by the engine's description, driving it over one Forward stream."""
    cfg = dataclasses.replace(sched_cfg, max_running_requests=min(sched_cfg.max_running_requests,
                                                                  desc.max_running_requests))
    scheduler = Scheduler(cfg, num_pages=desc.num_kv_slots // desc.page_size, page_size=desc.page_size,
                          max_context=desc.max_context_len, vocab_size=desc.vocab_size,
                          eos_token_ids=tuple(desc.eos_token_ids), decode=decode)
    return EngineLoop(scheduler, GrpcTransport(channel), overlap=overlap, max_queued_requests=max_queued,
                      name=address, on_failure=on_failure, lockstep=lockstep,
                      graph_batch_sizes=list(desc.cuda_graph_batch_sizes), tracing=tracing, dp_rank=desc.dp_rank)


def connect_engine(address: str, sched_cfg: SchedulerConfig, overlap: bool, max_queued: int,
                   wait: float) -> EngineLoop:
    channel, desc = describe_engine(address, wait)
    return engine_loop(address, channel, desc, sched_cfg, overlap, max_queued)


def engine_healthy(address: str, timeout: float = 2.0) -> bool:
    """One health check of an engine's Engine service."""
    with grpc.insecure_channel(address) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="modeserve.v1.Engine"), timeout=timeout).status
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING


def start_remote_router(address: str, engines: list[str], model: str | None, sched_cfg: SchedulerConfig,
                        overlap: bool = True, max_queued_requests: int = 1024, wait: float = 120.0,
                        dispatch: str = "prefix", lockstep: bool = False,
                        health_interval: float = 1.0, metrics_port: int | None = None,
                        watch: EngineSetWatch | None = None) -> RouterApp:
    """Router over remote engines; rank i is ``engines[i]``. With ``watch`` (not started yet; the
    router starts and stops it), the ranks are its EngineSet's instead: the router waits up to ``wait``
    seconds for a table with a rank, then follows every new one. Admin/SetRanks changes them too."""
    if watch is None:
        return _start(address, [RankSpec(i, e) for i, e in enumerate(engines)], model, sched_cfg, overlap,
                      max_queued_requests, wait, dispatch, lockstep, health_interval, metrics_port)
    try:
        app = _start(address, watch.start().wait_ranks(wait), model, sched_cfg, overlap, max_queued_requests,
                     wait, dispatch, lockstep, health_interval, metrics_port, follow=watch.follow)
    except BaseException:
        watch.stop()
        raise
    app.on_stop.append(watch.stop)
    return app


def _start(address: str, initial: list[RankSpec], model: str | None, sched_cfg: SchedulerConfig, overlap: bool,
           max_queued_requests: int, wait: float, dispatch: str, lockstep: bool, health_interval: float,
           metrics_port: int | None, follow: Callable[[Callable[[list[RankSpec]], None]], None] | None = None
           ) -> RouterApp:
    """``start_remote_router`` from its first ranks; ``follow`` hands it later ones."""
    if not initial:
        raise ValueError("router: no engines")
    first = next((s for s in initial if not s.draining), initial[0])
    _, desc = describe_engine(first.address, wait)  # the model's facts: tokenizer, limits
    source = model or (desc.model_path if Path(desc.model_path).exists() else None)
    tokenizer: Tokenizer | None = load_tokenizer(source) if source else None
    decode = tokenizer.decode if tokenizer is not None else None
    group = LockstepGroup() if lockstep else None
    tracing = Tracing("router")

    def connect(rank: int, addr: str, on_failure: Callable[[EngineLoop, list[RequestHandle]], None]) -> EngineLoop:
        channel, d = describe_engine(addr, wait)
        if d.model != desc.model or d.vocab_size != desc.vocab_size:
            raise ValueError(f"engine {addr} serves {d.model!r}, the router serves {desc.model!r}")
        loop = engine_loop(addr, channel, d, sched_cfg, overlap and not lockstep, max_queued_requests, decode,
                           on_failure, group, tracing)
        loop.start()
        return loop

    table = RankTable(connect, Dispatcher(dispatch), health=engine_healthy, health_interval=health_interval)
    table.set_ranks(initial)
    if follow is not None:
        follow(table.set_ranks)
    table.wait_ready(wait + 30)
    limits = RequestLimits(max_context=desc.max_context_len, vocab_size=desc.vocab_size,
                           max_new_tokens=desc.max_context_len, max_prompt_chars=64 * desc.max_context_len)
    return start_router(address, table, tokenizer, limits, desc.model, list(desc.eos_token_ids), metrics_port,
                        tracing)


def engineset_watch(name: str, namespace: str | None) -> EngineSetWatch:
    """The watch ``--engineset``/``--namespace`` ask for, with the environment's credentials."""
    try:
        from ..router.engineset_watch import EngineSetWatch, api_client_from_environment, pod_namespace
    except ImportError as exc:  # the kubernetes client comes with the `operator` extra (the image has it)
        raise ValueError(f"router: --engineset needs the kubernetes client (pip install 'modeserve[operator]'): "
                         f"{exc}") from exc

    namespace = namespace or pod_namespace()
    if not namespace:
        raise ValueError("router: --engineset needs --namespace (no $POD_NAMESPACE, no service account namespace)")
    return EngineSetWatch(api_client_from_environment(), namespace, name)


def run(args: argparse.Namespace) -> int:
    from ..rpc.grpc_server import grpc_address
    from ..router.app import serve_app

    watch = engineset_watch(args.engineset, args.namespace) if args.engineset else None
    engines = [e for e in (args.engines or "").split(",") if e]
    app = start_remote_router(grpc_address(args.host, args.port), engines,
                              args.model, SchedulerConfig(**engine_kwargs(args, (SchedulerConfig,))), args.overlap,
                              args.max_queued_requests, args.engine_wait, args.dispatch, args.dp_lockstep,
                              metrics_port=args.metrics_port, watch=watch)
    return serve_app(app, "router", args.host, args.grace_period)
