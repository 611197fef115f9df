"""The export process against a real OTLP/gRPC receiver: the spans it makes from records keep their
ids, parent, links, times, attributes and status; a flush returns once they are exported; the child
ends when its parent's pipe closes (the parent killed), and a child gone costs the parent nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from opentelemetry.trace import SpanKind

from modeserve.service.telemetry.export_process import ExportProcess
from modeserve.service.telemetry.tracing import Tracing, extract
from tests.service.test_serve_engine_process import wait_gone
from tests.service.test_tracing import Receiver, attrs, receiver  # noqa: F401  (the receiver fixture)


def test_records_become_the_spans_the_receiver_gets(receiver: Receiver) -> None:
    tracing = Tracing("router", 4)  # the fixture's OTEL_* variables: OTLP to the receiver
    request = tracing.start("text_completion m", None, SpanKind.SERVER, {"gen_ai.request.max_tokens": 8})
    step = tracing.start("modeserve.step", request.context, SpanKind.CLIENT, {"modeserve.batch_size": 1},
                         [request.context], start_time=1_000_000)
    request.links.append(step.context)
    tracing.end(step, end_time=3_000_000)
    request.set_error("client went away")
    tracing.end(request)
    client = extract({"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01", "tracestate": "vendor=x"})
    tracing.end(tracing.start("text_completion child", client, SpanKind.SERVER))
    tracing.flush()  # returns once the child has exported all three
    got = {s.name: (res, s) for res, s in receiver.spans}
    assert set(got) == {"text_completion m", "modeserve.step", "text_completion child"}
    child = got["text_completion child"][1]
    assert child.trace_id == bytes.fromhex("ab" * 16) and child.parent_span_id == bytes.fromhex("cd" * 8)
    assert child.trace_state == "vendor=x"
    (res, req), (_, st) = got["text_completion m"], got["modeserve.step"]
    assert req.span_id == request.context.span_id.to_bytes(8, "big") and not req.parent_span_id
    assert req.trace_id == st.trace_id == request.context.trace_id.to_bytes(16, "big")
    assert st.span_id == step.context.span_id.to_bytes(8, "big") and st.parent_span_id == req.span_id
    assert (st.start_time_unix_nano, st.end_time_unix_nano) == (1_000_000, 3_000_000)
    assert [bytes(link.span_id) for link in st.links] == [req.span_id]
    assert [bytes(link.span_id) for link in req.links] == [st.span_id]
    assert attrs(req) == {"gen_ai.request.max_tokens": 8} and attrs(st) == {"modeserve.batch_size": 1}
    assert req.status.code == 2 and req.status.message == "client went away"  # STATUS_CODE_ERROR
    assert st.kind == 3 and req.kind == 2  # CLIENT, SERVER
    assert res["service.name"] == "modeserve-test" and res["modeserve.dp_rank"] == 4
    tracing.shutdown()


def test_child_ends_when_its_parent_is_killed(receiver: Receiver) -> None:
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from modeserve.service.telemetry.export_process import ExportProcess\n"
        "sink = ExportProcess('engine', 0, os.environ)\n"
        "print(sink.pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    assert wait_gone(child, 20)


def test_a_child_gone_costs_the_parent_nothing(receiver: Receiver) -> None:
    tracing = Tracing("engine", 0)
    sink = ExportProcess("engine", 0, os.environ)
    os.kill(sink.pid, signal.SIGKILL)
    assert wait_gone(sink.pid, 10)
    for _ in range(200):
        sink.emit(tracing.start("modeserve.forward"))  # unsampled or not: a record is a record
    sink.flush()  # nothing to wait for: returns
    sink.shutdown()
    tracing.shutdown()


def test_settings_come_from_the_mapping_given(receiver: Receiver) -> None:
    """The child runs in the process's environment but reads OTEL_* from the mapping the serving
    side was given (the bench passes a mapping of its own)."""
    mapping = {"OTEL_EXPORTER_OTLP_ENDPOINT": os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"],
               "OTEL_SERVICE_NAME": "from-the-mapping"}
    tracing = Tracing("engine", 1, env=mapping)
    tracing.end(tracing.start("modeserve.forward"))
    tracing.flush()
    ((resource, span),) = receiver.spans
    assert span.name == "modeserve.forward" and resource["service.name"] == "from-the-mapping"
    tracing.shutdown()


def test_a_stuck_child_never_holds_up_the_serving_side(receiver: Receiver) -> None:
    """The child stopped (SIGSTOP): its pipe fills, the sender thread waits on it, and ``emit`` goes
    on appending until ``max_pending`` records wait, then drops; after SIGCONT every record kept is
    exported. (How many records reach the pipe before the emitter is done depends on when the sender
    thread gets the GIL, none at all on a busy 2-core machine, so at most ``total - max_pending`` drop.)"""
    import threading

    tracing = Tracing("engine", 0)
    sink = ExportProcess("engine", 0, os.environ, max_pending=500)
    os.kill(sink.pid, signal.SIGSTOP)
    total = 5000
    emitter = threading.Thread(target=lambda: [sink.emit(tracing.start("modeserve.forward")) for _ in range(total)])
    emitter.start()
    emitter.join(60)
    assert not emitter.is_alive()  # every emit returned while the child could read nothing
    assert 0 < sink.dropped <= total - 500
    os.kill(sink.pid, signal.SIGCONT)
    sink.flush()
    deadline = time.time() + 30
    while len(receiver.spans) < total - sink.dropped and time.time() < deadline:
        time.sleep(0.05)
    assert len(receiver.spans) == total - sink.dropped
    sink.shutdown()
    tracing.shutdown()
