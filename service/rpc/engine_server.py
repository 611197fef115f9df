"""The engine pod's gRPC service (``modeserve.v1.Engine``): ForwardBatch steps in, results out.

One ``ModelRunner`` serves every stream; it is not thread-safe, so launches run one at a time under
a lock. Each stream is independent: a bad batch ends only the stream that sent it, and validation
(``convert.batch_from_proto``) happens before the runner is touched.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterator, NoReturn, Sequence

import grpc
from grpc_health.v1 import health, health_pb2
from opentelemetry.trace import Span

from ...engine.forward_batch import ForwardBatch, ForwardResult
from ...engine.runner.host_io import PendingResult
from ...engine.runner.model_runner import ModelRunner
from ...engine.scheduler.stats import ForwardModeStats
from ...proto.v1 import engine_pb2, engine_pb2_grpc, forward_pb2
from .convert import BatchLimits, batch_from_proto, mode_stats_to_proto, result_to_proto
from .grpc_server import GrpcServer, create_grpc_server
from ..telemetry.metrics import MetricsServer, RankSample
from ..telemetry.step_tracing import end_forward_span, forward_span
from ..telemetry.tracing import Tracing

logger = logging.getLogger(__name__)

ENGINE_SERVICE = "modeserve.v1.Engine"


def batch_limits(runner: ModelRunner) -> BatchLimits:
    return BatchLimits(
        max_reqs=runner.cfg.max_running_requests,
        max_context=runner.max_context,
        num_kv_slots=runner.num_kv_slots,
        vocab_size=runner.model_config.vocab_size,
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
    )


@dataclass(frozen=True)
class _Launched:
    """A batch on the device: its result arrives through ``pending``."""

    batch: ForwardBatch
    start: float
    pending: PendingResult[ForwardResult]
    span: Span | None


def _read_all(request_iterator: Iterator[forward_pb2.ForwardBatch],
              inbox: queue.Queue[forward_pb2.ForwardBatch | None]) -> None:
    """Move a stream's messages into ``inbox``; None marks its end (closed, cancelled or broken)."""
    try:
        for msg in request_iterator:
            inbox.put(msg)
    except Exception:  # the RPC ended under us (cancelled, deadline): the stream is over either way
        pass
    finally:
        inbox.put(None)


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, runner: ModelRunner, description: engine_pb2.EngineDescription,
                 tracing: Tracing | None = None) -> None:
        self._runner = runner
        self.tracing = tracing or Tracing("engine", description.dp_rank, env={})
        self._limits = batch_limits(runner)
        self._description = description
        self._health: health.HealthServicer | None = None
        self._forward_lock = threading.Lock()  # the runner runs one batch at a time
        self.stats = ForwardModeStats()  # the steps this engine ran (Describe and /metrics read it)
        self._state_lock = threading.Lock()  # guards the two fields below
        self._active_streams = 0
        self._draining = False

    def attach_health(self, health_servicer: health.HealthServicer) -> None:
        """Report the Engine service NOT_SERVING (readiness) once draining; liveness is untouched."""
        with self._state_lock:
            self._health = health_servicer
        if self.draining:
            self._set_not_serving()

    def _set_not_serving(self) -> None:
        if self._health is not None:
            self._health.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

    @property
    def draining(self) -> bool:
        with self._state_lock:
            return self._draining

    @property
    def active_streams(self) -> int:
        with self._state_lock:
            return self._active_streams

    def drain(self) -> int:
        """Refuse new Forward streams from now on; returns the streams still running."""
        with self._state_lock:
            self._draining = True
            active = self._active_streams
        self._set_not_serving()
        return active

    @contextlib.contextmanager
    def _stream(self, context: grpc.ServicerContext) -> Iterator[None]:
        with self._state_lock:
            draining = self._draining
            if not draining:
                self._active_streams += 1
        if draining:
            _abort(context, grpc.StatusCode.UNAVAILABLE, "engine is draining: it accepts no new Forward streams")
        try:
            yield
        finally:
            with self._state_lock:
                self._active_streams -= 1

    # ---- RPCs ----------------------------------------------------------------------------------
    def Forward(self, request_iterator: Iterator[forward_pb2.ForwardBatch],
                context: grpc.ServicerContext) -> Iterator[forward_pb2.ForwardResult]:
        """Results in step order. A batch that has arrived is launched before the previous step's
        result is awaited, so the device runs step N while step N+1 is unpacked, uploaded and planned."""
        with self._stream(context):
            inbox: queue.Queue[forward_pb2.ForwardBatch | None] = queue.Queue()
            threading.Thread(target=_read_all, args=(request_iterator, inbox), name="engine-stream-reader",
                             daemon=True).start()
            pending: collections.deque[_Launched] = collections.deque()
            ended = False
            while not ended or pending:
                msg: forward_pb2.ForwardBatch | None = None
                if not ended:
                    try:
                        msg = inbox.get(block=not pending)
                        ended = msg is None
                    except queue.Empty:
                        pass
                if msg is not None:
                    launched = self._launch(msg)
                    if not isinstance(launched, _Launched):  # earlier steps' results first, then end this stream
                        while pending:
                            yield self._finish(pending.popleft())
                        _abort(context, *launched)
                    pending.append(launched)
                    if len(pending) < 2:
                        continue
                if pending:
                    yield self._finish(pending.popleft())

    def _launch(self, msg: forward_pb2.ForwardBatch) -> _Launched | tuple[grpc.StatusCode, str]:
        """Decode, validate and launch one batch (with its forward span when tracing); or the error."""
        try:
            batch = batch_from_proto(msg, self._limits)
        except ValueError as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, f"ForwardBatch step {msg.step}: {exc}"
        start = time.perf_counter()
        with self._forward_lock:
            try:
                pending = self._runner.launch(batch)
            except ValueError as exc:  # e.g. a known forward mode this build does not implement
                return grpc.StatusCode.INVALID_ARGUMENT, f"ForwardBatch step {msg.step}: {exc}"
            except Exception as exc:  # a device or model failure: end this stream, keep serving
                logger.exception("forward of step %d failed", msg.step)
                return grpc.StatusCode.INTERNAL, f"ForwardBatch step {msg.step}: forward failed: {exc!r}"
        return _Launched(batch, start, pending, forward_span(self.tracing, batch, self._description.dp_rank))

    def _finish(self, launched: _Launched) -> forward_pb2.ForwardResult:
        result = launched.pending.result()
        seconds = time.perf_counter() - launched.start
        end_forward_span(launched.span, result)
        batch = launched.batch
        self.stats.record(batch.forward_mode, batch.batch_size, batch.num_tokens, seconds)
        return result_to_proto(result, batch.step, seconds)

    def Describe(self, request: engine_pb2.DescribeRequest,
                 context: grpc.ServicerContext) -> engine_pb2.EngineDescription:
        description = engine_pb2.EngineDescription()
        description.CopyFrom(self._description)
        description.mode_stats.extend(mode_stats_to_proto([self.stats]))
        return description

    def rank_sample(self) -> RankSample:
        runner = self._runner
        return RankSample(str(self._description.dp_rank), self.stats,
                          graph_stats=runner.graphs.stats() if runner.graphs is not None else None)

    def Drain(self, request: engine_pb2.DrainRequest, context: grpc.ServicerContext) -> engine_pb2.DrainResponse:
        active = self.drain()
        return engine_pb2.DrainResponse(drained=active == 0, active_streams=active)


def create_engine_server(runner: ModelRunner, address: str, *, model_path: str | None = None,
                         eos_token_ids: Sequence[int] | None = None, dp_rank: int = 0,
                         metrics_port: int | None = None) -> GrpcServer:
    """Serve ``runner`` on ``address`` (``host:0`` picks a free port) with health and reflection.

    Draining marks the Engine service NOT_SERVING (readiness) while liveness ``""`` stays SERVING.
    """
    servicer = EngineServicer(runner, describe_runner(runner, model_path, eos_token_ids, dp_rank),
                              Tracing("engine", dp_rank))
    srv = create_grpc_server(
        address,
        [lambda server: engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)],
        [ENGINE_SERVICE],
    )
    servicer.attach_health(srv.health)
    if metrics_port is not None:
        srv.metrics_port = MetricsServer(lambda: [servicer.rank_sample()], router=False).start(metrics_port)
    return srv
