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
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from modeserve.service.telemetry.step_record import StepBatcher, StepRecord
from modeserve.service.telemetry.tracing import Tracing

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
        r = StepRecord(b, "modeserve.forward", first_id + i, PARENT, SpanKind.CLIENT,
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


def test_step_record_context_as_the_sdk_makes_a_childs() -> None:
    """A record's context is what the SDK gives a child of the same parent: its trace id, sampled
    flags with the parent's random-trace-id flag, the parent's trace state, a fresh span id drawn as
    the SDK's RandomIdGenerator draws it; remote and local parents alike."""
    import random

    from opentelemetry import trace
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
    from opentelemetry.trace import TraceState

    tracing = Tracing("engine", 0, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                                        "OTEL_BSP_SCHEDULE_DELAY": "60000"})
    random_flag = int(getattr(TraceFlags, "RANDOM_TRACE_ID", 0))
    parents = [NonRecordingSpan(SpanContext(0xA, 0xB, is_remote=True, trace_flags=TraceFlags(1 | random_flag))),
               NonRecordingSpan(SpanContext(0xA, 0xB, is_remote=True, trace_flags=TraceFlags(1),
                                            trace_state=TraceState([("k", "v")]))),
               tracing.start_span("request", kind=SpanKind.SERVER)]
    for parent in parents:
        random.seed(7)
        sdk = tracing.tracer.start_span("sdk child", trace.set_span_in_context(parent)).get_span_context()
        random.seed(7)
        step = tracing.start_step_span("modeserve.forward", parent, SpanKind.CLIENT, (), {})
        assert isinstance(step, StepRecord)
        ctx = step.get_span_context()
        assert (ctx.trace_id, ctx.trace_flags, ctx.trace_state, ctx.is_remote) == (
            sdk.trace_id, sdk.trace_flags, sdk.trace_state, sdk.is_remote)
        random.seed(7)
        assert ctx.span_id == RandomIdGenerator().generate_span_id()
        assert step.readable().context == ctx and step.readable().parent == parent.get_span_context()
    tracing.shutdown()


def test_step_records_take_span_ids_from_another_id_generator(monkeypatch: Any) -> None:
    """A provider whose id generator is not the SDK's random one is asked for each span id."""
    from opentelemetry.sdk import trace as sdk_trace
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class Counting(RandomIdGenerator):
        next_id = 100

        def generate_span_id(self) -> int:
            Counting.next_id += 1
            return Counting.next_id

    monkeypatch.setattr(sdk_trace, "RandomIdGenerator", Counting)  # the provider's default generator
    tracing = Tracing("engine", 0, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                                        "OTEL_BSP_SCHEDULE_DELAY": "60000"})
    assert type(tracing._provider.id_generator) is Counting  # type: ignore[attr-defined]
    spans = [tracing.start_step_span("modeserve.forward", NonRecordingSpan(PARENT), SpanKind.CLIENT, (), {})
             for _ in range(3)]
    assert [s.context.span_id for s in spans if s is not None] == [101, 102, 103]
    tracing.shutdown()
