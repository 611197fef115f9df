"""The engine pod's gRPC service (``modeserve.v1.Engine``): ForwardBatch steps in, results out.

The RPCs run on the server's event loop, each stream's steps on a thread of its own. One
``ModelRunner`` serves every stream; it is not thread-safe, so launches run one at a time under a lock.
Each stream is independent: a bad batch ends only the stream that sent it, and validation
(``convert.batch_from_proto``) happens before the runner is touched.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc
from google.protobuf.message import DecodeError

from ...engine.forward_batch import ForwardBatch
from ...engine.runner.model_runner import ModelRunner
from ...engine.scheduler.stats import ForwardModeStats
from ...proto.v1 import engine_pb2, engine_pb2_grpc, forward_pb2
from .batch_checks import BatchLimits
from .convert import mode_stats_to_proto
from .engine_client import ENGINE_SERVICE
from .forward_stream import ForwardStream, SharedRunner, StepError
from .grpc_server import EventLoopThread, GrpcServer, ServerOptions
from .tls import ReloadingServerCredentials, TlsFiles
from ..telemetry.metrics import MetricsServer, RankSample
from ..telemetry.tracing import Tracing


def batch_limits(runner: ModelRunner) -> BatchLimits:
    return BatchLimits(
        max_reqs=runner.cfg.max_running_requests,
        max_context=runner.max_context,
        num_kv_slots=runner.num_kv_slots,
        vocab_size=runner.model_config.vocab_size,
        num_layers=runner.model_config.num_layers,
    )


def describe_runner(runner: ModelRunner, model_path: str | None = None,
                    eos_token_ids: Sequence[int] | None = None, dp_rank: int = 0) -> engine_pb2.EngineDescription:
    """What a scheduler needs to drive this engine. ``eos_token_ids`` defaults to the checkpoint's."""
    eos = runner.model_config.eos_token_ids if eos_token_ids is None else eos_token_ids
    return engine_pb2.EngineDescription(
        model=runner.model_config.name,
        model_path=model_path if model_path is not None else (runner.cfg.model or ""),
        num_kv_slots=runner.num_kv_slots,
        page_size=runner.cfg.page_size,
        max_running_requests=runner.cfg.max_running_requests,
        max_context_len=runner.max_context,
        vocab_size=runner.model_config.vocab_size,
        eos_token_ids=list(dict.fromkeys(eos)),
        cuda_graph_batch_sizes=runner.graphs.buckets if runner.graphs is not None else [],
        dp_rank=dp_rank,
        device=str(runner.device),
        dtype=runner.cfg.torch_dtype_name,
        attention_backend=runner.attention_backend_name,
        num_layers=runner.model_config.num_layers,
        dllm_block_size=runner.dllm.block_size if runner.dllm is not None else 0,
        dllm_mask_token_id=runner.dllm.mask_token_id if runner.dllm is not None else 0,
    )


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, runner: ModelRunner, description: engine_pb2.EngineDescription,
                 tracing: Tracing | None = None) -> None:
        self._model_runner = runner
        self._runner = SharedRunner(runner)  # every stream's steps go through it, one launch at a time
        self.tracing = tracing or Tracing("engine", description.dp_rank, env={})
        self._limits = batch_limits(runner)
        self._description = description
        self.stats = ForwardModeStats()  # the steps this engine ran (Describe and /metrics read it)
        self.server: GrpcServer | None = None  # its readiness turns NOT_SERVING on Drain
        self.active_streams = 0  # these two: on the event loop only
        self.draining = False
        self._steppers: list[tuple[ForwardStream, threading.Thread]] = []  # each stream's step thread

    # ---- RPCs ----------------------------------------------------------------------------------
    async def Forward(self, request_iterator: AsyncIterator[forward_pb2.ForwardBatch],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[forward_pb2.ForwardResult]:
        """Results in step order (a split prefill's slices beside the decodes: when done); a bad batch or
        a failed forward ends only this stream."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is draining: it accepts no new Forward streams")
        self.active_streams += 1
        stream = ForwardStream(self._limits, self.tracing, self._description.dp_rank, self.stats,
                               asyncio.get_running_loop())
        undecodable: list[str] = []
        reader = asyncio.ensure_future(stream.read(_decoded(request_iterator, undecodable)))
        # slices beside the decode steps: a slice's result goes out when done, after later steps' maybe
        defer = ForwardBatch.is_slice if self._model_runner.side_stream is not None else None
        stepper = threading.Thread(target=stream.run, args=(self._runner, defer), name="forward-steps", daemon=True)
        self._steppers = [(s, t) for s, t in self._steppers if t.is_alive()] + [(stream, stepper)]
        stepper.start()
        try:
            while (item := await stream.results.get()) is not None:
                if isinstance(item, StepError):
                    await context.abort(item.code, str(item))  # raises
                else:
                    yield item
            if undecodable:  # the steps before it have their results; the stream must not end OK
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"a ForwardBatch does not parse: {undecodable[0]}")
        finally:  # ended, failed or cancelled: the reader's end stops the steps
            self.active_streams -= 1
            reader.cancel()

    def end_streams(self, timeout: float) -> None:
        """Stop every stream's steps after those in flight and wait up to ``timeout`` seconds for them: a
        step still running in the model while the process exits would abort it (SIGABRT)."""
        deadline = time.monotonic() + timeout
        for stream, stepper in self._steppers:
            stream.ended = True
            stepper.join(max(0.0, deadline - time.monotonic()))

    async def Describe(self, request: engine_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> engine_pb2.EngineDescription:
        description = engine_pb2.EngineDescription()
        description.CopyFrom(self._description)
        description.mode_stats.extend(mode_stats_to_proto([self.stats]))
        return description

    def rank_sample(self) -> RankSample:
        runner = self._model_runner
        return RankSample(str(self._description.dp_rank), self.stats,
                          graph_stats=runner.graphs.stats() if runner.graphs is not None else None)

    async def Drain(self, request: engine_pb2.DrainRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.DrainResponse:
        """Refuse new Forward streams from now on (readiness NOT_SERVING, liveness untouched)."""
        self.draining = True
        if self.server is not None:
            await self.server.set_not_serving(ENGINE_SERVICE)
        return engine_pb2.DrainResponse(drained=self.active_streams == 0, active_streams=self.active_streams)


async def _decoded(requests: AsyncIterator[forward_pb2.ForwardBatch],
                   undecodable: list[str]) -> AsyncIterator[forward_pb2.ForwardBatch]:
    """The stream's batches up to one that does not parse (grpc raises the parser's error from the
    iterator), whose error goes to ``undecodable``."""
    try:
        async for msg in requests:
            yield msg
    except DecodeError as exc:
        undecodable.append(str(exc))


@dataclass
class EngineServer:
    """A serving engine: its gRPC server on an event loop of its own, and its /metrics."""

    events: EventLoopThread
    server: GrpcServer
    servicer: EngineServicer
    metrics: MetricsServer | None = None

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self, grace: float, step_wait: float = 30.0) -> None:
        """Report NOT_SERVING, refuse new streams, let running ones finish within ``grace`` seconds; then
        wait up to ``step_wait`` more for the steps still in flight (a process that exits in the middle of
        one aborts)."""
        self.server.shutdown(grace)
        self.servicer.end_streams(step_wait)
        self.events.close()
        if self.metrics is not None:
            self.metrics.stop()
        self.servicer.tracing.shutdown()


def create_engine_server(runner: ModelRunner, address: str, *, model_path: str | None = None,
                         eos_token_ids: Sequence[int] | None = None, dp_rank: int = 0,
                         metrics_port: int | None = None, tls: TlsFiles | None = None,
                         options: ServerOptions = ServerOptions()) -> EngineServer:
    """Serve ``runner`` on ``address`` (``host:0`` picks a free port) with health and reflection; over
    TLS with ``tls`` (mutual, when it names a CA: only routers with a certificate it signed get in)."""
    credentials = ReloadingServerCredentials(tls, tls.ca is not None).credentials if tls is not None else None
    servicer = EngineServicer(runner, describe_runner(runner, model_path, eos_token_ids, dp_rank),
                              Tracing("engine", dp_rank))
    events = EventLoopThread("engine-grpc")
    servicer.server = GrpcServer(events, address, [lambda s: engine_pb2_grpc.add_EngineServicer_to_server(servicer, s)],
                                 [ENGINE_SERVICE], credentials=credentials, options=options)
    srv = EngineServer(events, servicer.server, servicer)
    if metrics_port is not None:
        srv.metrics = MetricsServer(lambda: [servicer.rank_sample()], router=False)
        srv.metrics.start(metrics_port)
    return srv
