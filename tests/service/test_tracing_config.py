"""OpenTelemetry configuration and context propagation, without servers or a model: with no OTEL
endpoint (or the SDK disabled) nothing is traced; the batch processor's settings, the resource and
the sampler come from the ``OTEL_*`` environment; the engine's forward span is a child of the
router's injected trace context, sampled as its flags say, and a root span where the context is
invalid or missing.
"""

from __future__ import annotations

import os

import pytest
from opentelemetry import trace

from modeserve.service.telemetry.tracing import Tracing


def test_tracing_off_without_endpoint() -> None:
    tr = Tracing("router", env={})
    assert not tr.enabled
    record = tr.start("x")
    assert not record.context.is_valid and not record.recording
    assert Tracing("router", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"}).enabled is False


def test_export_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The export process keeps this process's environment but takes its OTEL_* from the mapping,
    with the batch processor's defaults where the mapping sets none."""
    from modeserve.service.telemetry.otel_env import export_environment

    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-the-process")
    monkeypatch.setenv("MODESERVE_TEST_VAR", "kept")
    env = export_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_BSP_SCHEDULE_DELAY": "20",
                              "PATH": "/not/taken"})
    assert env["MODESERVE_TEST_VAR"] == "kept" and env["PATH"] == os.environ["PATH"]
    assert "OTEL_SERVICE_NAME" not in env and env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://x:4317"
    assert env["OTEL_BSP_SCHEDULE_DELAY"] == "20" and env["OTEL_BSP_MAX_QUEUE_SIZE"] == "8192"
    assert export_environment({})["OTEL_BSP_SCHEDULE_DELAY"] == "50"


def test_resource_and_sampler_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.trace import sampling
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from modeserve.service.telemetry.otel_env import process_resource, sampler_from_env

    monkeypatch.setenv("OTEL_SERVICE_NAME", "svc")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "a=1, b = 2,modeserve.dp_rank=9,k8s.pod.name=pod-0,bad")
    attributes = dict(process_resource("engine", 3).attributes)
    assert {k: attributes[k] for k in ("service.name", "modeserve.component", "modeserve.dp_rank", "k8s.pod.name",
                                       "a", "b")} == {"service.name": "svc", "modeserve.component": "engine",
                                                      "modeserve.dp_rank": 3, "k8s.pod.name": "pod-0", "a": "1", "b": "2"}
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES")
    attributes = dict(process_resource("router", None).attributes)
    assert attributes["service.name"] == "modeserve-router" and "modeserve.dp_rank" not in attributes
    assert sampler_from_env({}).get_description() == sampling.ParentBased(sampling.ALWAYS_ON).get_description()
    ratio = sampler_from_env({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"})
    assert isinstance(ratio, sampling.TraceIdRatioBased) and ratio.rate == 0.25
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER"):
        sampler_from_env({"OTEL_TRACES_SAMPLER": "sometimes"})
    assert not Tracing("router", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317",
                                      "OTEL_TRACES_EXPORTER": "none"}).enabled
    exporter = InMemorySpanExporter()
    tracing = Tracing("router", env={}, exporter=exporter)
    tracing.end(tracing.start("at", start_time=1_000), end_time=2_000)
    (span,) = exporter.get_finished_spans()
    assert (span.start_time, span.end_time) == (1_000, 2_000)
    ratio_env = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    ratio_tracing = Tracing("router", env=ratio_env, exporter=InMemorySpanExporter())
    records = [ratio_tracing.start("r") for _ in range(400)]
    decide = sampling.TraceIdRatioBased(0.5).should_sample  # the SDK's own decision for each trace id
    assert [r.sampled for r in records] == [decide(None, r.context.trace_id, "r").decision.is_sampled() for r in records]
    assert 120 < sum(r.sampled for r in records) < 280


def test_engine_reads_the_routers_trace_context() -> None:
    """The engine's forward span is a child of the injected context, sampled as its flags say (trace
    state kept); an invalid ``traceparent`` or none makes a root span."""
    import dataclasses

    import numpy as np
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from modeserve.engine.forward_batch import ForwardBatch, ForwardResult
    from modeserve.engine.forward_mode import ForwardMode
    from modeserve.service.telemetry.step_tracing import end_forward_span, forward_span
    from modeserve.service.telemetry.tracing import extract, inject

    exporter = InMemorySpanExporter()
    engine = Tracing("engine", 1, env={}, exporter=exporter)
    router = Tracing("router", env={}, exporter=InMemorySpanExporter())
    ctx = router.start("modeserve.step").context
    assert extract(inject(ctx)) == trace.SpanContext(ctx.trace_id, ctx.span_id, True, ctx.trace_flags)
    upper = {"traceparent": inject(ctx)["traceparent"].upper().replace("X", "x")}
    assert extract(upper) is None  # version 00 is lower case: invalid, as the propagator says
    with_state = {**inject(ctx), "tracestate": "vendor=x"}
    assert extract(with_state).trace_state == trace.TraceState([("vendor", "x")])  # type: ignore[union-attr]
    assert extract({}) is None and extract({"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"}) is None
    ids = np.arange(4, dtype=np.int64)
    decode = ForwardBatch(ForwardMode.DECODE, ids, ids, np.ones(4, dtype=np.int64), np.ones(4, dtype=bool), ids, ids,
                          ids)
    span = forward_span(engine, dataclasses.replace(decode, trace_context=with_state), 1)
    assert span is not None
    end_forward_span(engine, span, ForwardResult(ids, cuda_graph_bucket=8))
    unsampled = {"traceparent": inject(ctx)["traceparent"][:-2] + "00"}
    assert forward_span(engine, dataclasses.replace(decode, trace_context=unsampled), 1) is None
    root = forward_span(engine, ForwardBatch.idle(), 1)
    assert root is not None
    end_forward_span(engine, root, ForwardResult(ids[:0]))
    invalid = forward_span(engine, dataclasses.replace(decode, trace_context=upper), 1)
    assert invalid is not None and invalid.parent is None
    engine.end(invalid)
    assert forward_span(Tracing("engine", 1, env={}), decode, 1) is None  # tracing off
    (forward, alone, _) = exporter.get_finished_spans()
    assert forward.parent == extract(with_state) and forward.context.trace_id == ctx.trace_id
    assert forward.context.trace_state == trace.TraceState([("vendor", "x")])
    assert forward.kind == trace.SpanKind.SERVER and forward.context.trace_flags.sampled
    assert dict(forward.attributes) == {"modeserve.forward_mode": "DECODE", "modeserve.batch_size": 4,
                                        "modeserve.num_tokens": 4, "modeserve.dp_rank": 1,
                                        "modeserve.cuda_graph": True, "modeserve.padded_batch_size": 8}
    assert alone.parent is None and alone.attributes["modeserve.forward_mode"] == "IDLE"
    assert alone.attributes["modeserve.cuda_graph"] is False and alone.attributes["modeserve.padded_batch_size"] == 0
    assert forward.resource.attributes["modeserve.dp_rank"] == 1
