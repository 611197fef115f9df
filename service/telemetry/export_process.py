"""``ExportProcess``: ended span records go, pickled in batches over a pipe, to a child process
(``python -m modeserve.service.telemetry.export_process``) that makes them SDK spans and exports them
over OTLP/gRPC (the SDK's exporter under its batch processor).

Making an SDK span and encoding it for OTLP costs tens of microseconds of interpreter time each;
in the serving process that time, and the GIL it holds, would be taken from the step loop (a 1B
model's decode step is about a millisecond). The serving process only pickles small records, a batch
at a time. The child is a plain subprocess (not ``multiprocessing``'s spawn, which would import the
parent's main script again) and ends when its stdin closes: its parent stopped, or was killed.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import threading
from typing import IO, Mapping

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from ...engine.python_child import python_argv
from .otel_env import export_environment, process_resource
from .span_record import SdkSink, SpanRecord, from_wire, to_wire

logger = logging.getLogger(__name__)

SEND_BATCH = 64  # records sent together (or fewer, after SEND_INTERVAL seconds)
SEND_INTERVAL = 0.1
MAX_PENDING = 65536  # unsent records kept while the child lags
_FLUSH = "flush"


def export(component: str, dp_rank: int | None, inbox: IO[bytes], replies: IO[bytes]) -> None:
    """The child: record batches to make and export come on ``inbox`` (the SDK reads its settings
    from the environment); at a flush request, export all, then write a line to ``replies``."""
    sink = SdkSink(process_resource(component, dp_rank), BatchSpanProcessor(OTLPSpanExporter()))
    try:
        while True:
            try:
                msg = pickle.load(inbox)
            except EOFError:
                break
            if msg == _FLUSH:
                sink.flush()
                replies.write(b"\n")
                replies.flush()
                continue
            for record in msg:
                sink.emit(from_wire(record))
    finally:
        sink.shutdown()


class ExportProcess:
    """The serving side: ``emit`` from any thread (it only appends: the sender thread turns records
    into plain values and writes the pipe, so neither that nor a slow or stuck child holds up a step); ``flush`` waits until the child has
    exported everything emitted before it. Past ``max_pending`` unsent records, new ones are dropped
    (as the SDK's full queue drops spans)."""

    def __init__(self, component: str, dp_rank: int | None, env: Mapping[str, str],
                 max_pending: int = MAX_PENDING) -> None:
        rank = [] if dp_rank is None else [str(dp_rank)]
        self._proc = subprocess.Popen(python_argv("-m", __name__, component, *rank), env=export_environment(env),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._out, self._replies = self._proc.stdin, self._proc.stdout
        self._lock = threading.Lock()  # the pending records
        self._pipe = threading.Lock()  # the pipe: the sender's batches and a flush's request
        self._pending: list[SpanRecord] = []
        self._max_pending = max_pending
        self.dropped = 0
        self._ready = threading.Event()  # a batch is full
        self._closed = threading.Event()
        self._sender = threading.Thread(target=self._send, name="otlp-records", daemon=True)
        self._sender.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def emit(self, record: SpanRecord) -> None:
        """Queue an ended record (nothing changes it any more: the sender reads it later)."""
        with self._lock:
            if len(self._pending) >= self._max_pending:
                self.dropped += 1
                return
            self._pending.append(record)
            if len(self._pending) == SEND_BATCH:
                self._ready.set()

    def _write(self, msg: object | None = None) -> bool:
        """Send the pending records (then ``msg``); False once the child is gone. Holds ``_pipe``."""
        with self._lock:
            batch, self._pending = self._pending, []
        if self._closed.is_set():
            return False
        try:
            if batch:
                pickle.dump([to_wire(r) for r in batch], self._out, pickle.HIGHEST_PROTOCOL)
            if msg is not None:
                pickle.dump(msg, self._out, pickle.HIGHEST_PROTOCOL)
            self._out.flush()
            return True
        except (OSError, ValueError):  # the child is gone: spans are lost, serving goes on
            logger.warning("the span export process is gone; %d spans dropped", len(batch))
            self._closed.set()
            return False

    def _send(self) -> None:
        while not self._closed.is_set():
            self._ready.wait(SEND_INTERVAL)
            self._ready.clear()
            if self._pending:
                with self._pipe:
                    self._write()

    def flush(self) -> None:
        with self._pipe:
            if self._write(_FLUSH) and not self._replies.readline():
                self._closed.set()  # no reply: the child is gone

    def shutdown(self) -> None:
        """Send what is pending, let the child export it and end."""
        with self._pipe:
            self._write()
            self._closed.set()
            self._ready.set()
            try:
                self._out.close()
            except OSError:  # the child is gone with data unread
                pass
        self._sender.join(timeout=5)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._replies.close()


if __name__ == "__main__":
    export(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None, sys.stdin.buffer, sys.stdout.buffer)
