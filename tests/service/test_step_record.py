"""``StepBatcher``: ended step records reach the exporter in batches (when a batch is full, on its
timer, on flush and at shutdown), the oldest are dropped past the queue's size, an exporter that
fails does not stop it; ``Tracing`` with an OTLP endpoint makes step spans as records."""

from __future__ import annotations

import threading
import time
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from modeserve.service.step_record import StepBatcher, StepRecord
from modeserve.service.tracing import Tracing

PARENT = SpanContext(0x1, 0x2, is_remote=False, trace_flags=TraceFlags(1))


class Collect:
    def __init__(self, fail_first: int = 0) -> None:
        self.batches: list[list[Any]] = []
        self.fail_first = fail_first
        self.exported = threading.Event()
        self.shut = False

    def export(self, batch: list[Any]) -> SpanExportResult:
        if self.fail_first:
            self.fail_first -= 1
            raise RuntimeError("collector down")
        self.batches.append(batch)
        self.exported.set()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.shut = True


def batcher(exporter: Collect, delay_ms: int = 60_000, batch: int = 4, queue: int = 100) -> StepBatcher:
    return StepBatcher(exporter, Resource({}), InstrumentationScope("t"),  # type: ignore[arg-type]
                       schedule_delay_millis=delay_ms, max_export_batch_size=batch, max_queue_size=queue)


def end_records(b: StepBatcher, n: int, first_id: int = 1) -> list[StepRecord]:
    out = []
    for i in range(n):
        r = StepRecord(b, "modeserve.forward", PARENT.trace_id, first_id + i, TraceFlags(1), PARENT, SpanKind.CLIENT,
                       (), {"modeserve.batch_size": i})
        r.end()
        out.append(r)
    return out


def test_a_full_batch_wakes_the_thread_and_flush_exports_the_rest() -> None:
    exp = Collect()
    b = batcher(exp)
    made = end_records(b, 6)
    assert exp.exported.wait(5)  # the 4th record woke the thread (the timer is a minute)
    b.flush()
    assert [r for batch in exp.batches for r in batch] == made and max(map(len, exp.batches)) <= 4
    assert all(r.end_time >= r.start_time > 0 for r in made)
    b.shutdown()
    assert exp.shut


def test_timer_exports_and_shutdown_exports_what_is_left() -> None:
    exp = Collect()
    b = batcher(exp, delay_ms=50, batch=1000)
    end_records(b, 2)
    deadline = time.time() + 5
    while time.time() < deadline and not exp.batches:
        time.sleep(0.01)
    assert len(exp.batches[0]) == 2
    b2 = batcher(Collect(), batch=1000)
    left = end_records(b2, 3)
    exp2: Collect = b2._exporter  # type: ignore[assignment]
    b2.shutdown()
    assert exp2.batches == [left] and exp2.shut


def test_oldest_dropped_past_the_queue_and_a_failing_exporter_is_survived() -> None:
    exp = Collect(fail_first=1)
    b = batcher(exp, batch=1000, queue=5)
    made = end_records(b, 8)
    assert b.dropped == 3
    b.flush()  # the first export fails (logged): those records are gone, the batcher goes on
    later = end_records(b, 2, first_id=100)
    b.flush()
    assert exp.batches == [later]
    b.shutdown()
    assert made  # (the dropped ones were the three oldest)


def test_tracing_with_an_endpoint_makes_step_records() -> None:
    tracing = Tracing("engine", 0, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_BSP_SCHEDULE_DELAY": "60000"})
    request = tracing.start_span("request", kind=SpanKind.SERVER)
    step = tracing.start_step_span("modeserve.forward", request, SpanKind.CLIENT, (PARENT,), {"modeserve.batch_size": 1})
    assert isinstance(step, StepRecord)
    ctx = step.context
    assert ctx.trace_id == request.get_span_context().trace_id and ctx.span_id != 0 and ctx.trace_flags.sampled
    assert step.parent == request.get_span_context() and step.links == (PARENT,)
    readable = step.readable()
    assert readable.context == ctx and [link.context for link in readable.links] == [PARENT]
    tracing.shutdown()  # nothing ended: nothing is sent to the (absent) collector
