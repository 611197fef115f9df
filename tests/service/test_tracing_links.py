"""OpenTelemetry links between requests and the steps that serve them: a request span links to its
first MAX_STEP_LINKS step spans and those link back to the other requests they serve (later steps
carry none), every step staying in the trace of the request it started in; unsampled requests make
no step spans; a request whose client goes away mid-stream still ends, linked to its steps. In
memory (``InMemorySpanExporter``), over a ``RankLoop`` or an in-process serve.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from modeserve.service.telemetry.tracing import Tracing


def _traced_loop(tiny_model: Path, tracing: Tracing) -> Any:
    from modeserve.engine.llm import LLM
    from modeserve.service.router.rank_loop import RankLoop
    from modeserve.service.router.rank_policy import FreeRunning
    from modeserve.service.telemetry.step_tracing import StepTracer

    llm = LLM(model=str(tiny_model), page_size=4, max_running_requests=4)
    return RankLoop("traced", llm.scheduler, llm.runner, FreeRunning(2), tracer=StepTracer(tracing, 0, in_process=True))


def _generate(loop: Any, tracing: Tracing, prompts: list[list[int]], max_new_tokens: int) -> list[Any]:
    """Requests submitted before the loop starts (so every step serves all of them), each with a
    request span (as the router makes); their spans."""
    from modeserve.engine.sampling_params import SamplingParams
    from modeserve.service.router.request_handle import RequestHandle
    from modeserve.service.telemetry.step_tracing import RequestTrace

    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    handles = [RequestHandle(loop.scheduler.make_request(f"r{i}", p, sp),
                             trace=RequestTrace(tracing, tracing.start(f"text_completion r{i}")))
               for i, p in enumerate(prompts)]
    for h in handles:
        loop.submit(h)
    loop.start()
    for h in handles:
        while h.updates.get(timeout=60).finish_reason is None:
            pass
        h.trace.end()
    return [h.trace for h in handles]


def test_requests_and_their_first_steps_link_each_other(tiny_model: Path) -> None:
    """A request links to its first MAX_STEP_LINKS steps and those link back to the requests they
    serve other than their parent; later steps carry no links. Every step stays in the trace of the
    request it started in while that one runs."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from modeserve.service.telemetry.step_tracing import MAX_STEP_LINKS

    exporter = InMemorySpanExporter()
    tracing = Tracing("router", 0, env={}, exporter=exporter)
    loop = _traced_loop(tiny_model, tracing)
    try:
        _generate(loop, tracing, [[3, 4, 5, 6, 7], [8, 9, 10]], max_new_tokens=40)
    finally:
        loop.stop()
    spans = exporter.get_finished_spans()
    requests = {s.context.span_id: s for s in spans if s.name.startswith("text_completion")}
    steps = sorted((s for s in spans if s.name == "modeserve.forward"), key=lambda s: s.start_time)
    assert len(requests) == 2 and len(steps) >= 40
    limit = MAX_STEP_LINKS
    first = [s.context.span_id for s in steps[:limit]]
    assert all(s.attributes["modeserve.batch_size"] == 2 for s in steps)
    assert all([link.context.span_id for link in req.links] == first for req in requests.values())
    (parent,) = {s.parent.span_id for s in steps}
    (other,) = set(requests) - {parent}
    assert all([link.context.span_id for link in s.links] == [other] for s in steps[:limit])
    assert all(not s.links for s in steps[limit:])
    a = steps[-1].attributes
    assert a["modeserve.forward_mode"] == "DECODE" and a["modeserve.batch_size"] == 2 and a["modeserve.num_tokens"] == 2
    assert a["modeserve.cuda_graph"] is False and a["modeserve.padded_batch_size"] == 2 and a["modeserve.dp_rank"] == 0


def test_unsampled_requests_make_no_step_spans(tiny_model: Path) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing = Tracing("router", 0, env={"OTEL_TRACES_SAMPLER": "always_off"}, exporter=exporter)
    loop = _traced_loop(tiny_model, tracing)
    try:
        spans = _generate(loop, tracing, [[3, 4, 5]], max_new_tokens=4)
    finally:
        loop.stop()
    assert not spans[0].context.trace_flags.sampled and not exporter.get_finished_spans()


def test_cancelled_request_keeps_its_step_links(tiny_model: Path) -> None:
    """A client that goes away after a few tokens (before the request's MAX_STEP_LINKS-th step): its
    stream is closed at a yield, and the request span still ends, linked to the steps that served it."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from modeserve.service.rpc.client import GenerateClient
    from modeserve.service.router.in_process import start_serve

    exporter = InMemorySpanExporter()
    app = start_serve("127.0.0.1:0", str(tiny_model), tracing=Tracing("router", 0, env={}, exporter=exporter),
                      page_size=4)
    client = GenerateClient(f"127.0.0.1:{app.port}")
    try:
        stream = client.stream(token_ids=list(range(3, 13)), max_new_tokens=200, ignore_eos=True)
        got = 0
        for msg in stream:
            got += len(msg.token_ids)
            if got >= 3:
                break
        stream.cancel()  # type: ignore[attr-defined]
        deadline = time.time() + 10
        while time.time() < deadline and not any(s.name.startswith("text_completion") for s in exporter.get_finished_spans()):
            time.sleep(0.05)
    finally:
        client.close()
        app.stop(grace=1)
    spans = exporter.get_finished_spans()
    (request,) = [s for s in spans if s.name.startswith("text_completion")]
    steps = [s for s in spans if s.name == "modeserve.forward" and s.parent.span_id == request.context.span_id]
    linked = [link.context.span_id for link in request.links]
    assert request.status.description == "client went away"  # ended, although its stream was closed mid-way
    assert len(linked) >= 3  # the prefill and the decodes before the client left
    assert set(linked) <= {s.context.span_id for s in steps}
