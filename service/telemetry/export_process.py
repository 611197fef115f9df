"""``ExportProcess``: ended span records go, in batches over a pipe, to a child process that makes
them SDK spans and exports them over OTLP/gRPC (the SDK's exporter under its batch processor).

Making an SDK span and encoding it for OTLP costs tens of microseconds of interpreter time each;
in the serving process that time, and the GIL it holds, would be taken from the step loop (a 1B
model's decode step is about a millisecond). The serving process only pickles small records, a batch
at a time. The child ends when the pipe closes (its parent stopped, or was killed).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from multiprocessing.connection import Connection
from typing import Mapping

from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .otel_env import batch_settings_from_env, otlp_exporter_from_env, resource_from_env
from .span_record import SdkSink, SpanRecord

logger = logging.getLogger(__name__)

SEND_BATCH = 64  # records sent together (or fewer, after SEND_INTERVAL seconds)
SEND_INTERVAL = 0.1
_FLUSH = "flush"


def _export(conn: Connection, component: str, dp_rank: int | None, env: dict[str, str]) -> None:
    """The child: make and export what arrives; at a flush request, export all and reply."""
    sink = SdkSink(resource_from_env(component, dp_rank, env),
                   BatchSpanProcessor(otlp_exporter_from_env(env), **batch_settings_from_env(env)))
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg == _FLUSH:
                sink.flush()
                conn.send(_FLUSH)
                continue
            for record in msg:
                sink.emit(record)
    finally:
        sink.shutdown()


class ExportProcess:
    """The serving side: ``emit`` from any thread; ``flush`` waits until the child has exported
    everything emitted before it."""

    def __init__(self, component: str, dp_rank: int | None, env: Mapping[str, str]) -> None:
        ctx = multiprocessing.get_context("spawn")  # not fork: the parent has CUDA and gRPC threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_export, args=(child, component, dp_rank, dict(env)),
                                 name=f"modeserve-{component}-otlp", daemon=True)
        self._proc.start()
        child.close()
        self._lock = threading.Lock()  # the pending batch and the pipe
        self._pending: list[SpanRecord] = []
        self._closed = threading.Event()
        self._sender = threading.Thread(target=self._send_stale, name="otlp-records", daemon=True)
        self._sender.start()

    def emit(self, record: SpanRecord) -> None:
        with self._lock:
            self._pending.append(record)
            if len(self._pending) >= SEND_BATCH:
                self._send_locked()

    def _send_locked(self) -> None:
        batch, self._pending = self._pending, []
        if batch and not self._closed.is_set():
            try:
                self._conn.send(batch)
            except (BrokenPipeError, OSError):  # the child is gone: spans are lost, serving goes on
                logger.warning("the span export process is gone; %d spans dropped", len(batch))

    def _send_stale(self) -> None:
        while not self._closed.wait(SEND_INTERVAL):
            if self._pending:
                with self._lock:
                    self._send_locked()

    def flush(self) -> None:
        with self._lock:
            self._send_locked()
            if self._closed.is_set() or not self._proc.is_alive():
                return
            self._conn.send(_FLUSH)
            self._conn.recv()

    def shutdown(self) -> None:
        """Send what is pending, let the child export it and end."""
        with self._lock:
            self._send_locked()
            self._closed.set()
            self._conn.close()
        self._sender.join(timeout=5)
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
