"""The spans of steps: the router's ``modeserve.step`` (or, with the engine in its process, the one
``modeserve.forward``) span of each step, and the engine server's ``modeserve.forward`` span.

A step serves many requests but a span has one parent: the step span is a child of one sampled
request's span (the *head*: the previous step's while it is still served and recording, so a decode
stays in one trace), and links to the step's other requests; each request span links back to the
step spans. A request and each of its first ``MAX_STEP_LINKS`` steps link to each other; later steps
add no links, so a long decode's spans stay small. The router's step span travels to a remote engine
as ``ForwardBatch.trace_context``; the engine's forward span is its child.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import Link, Span, SpanContext, SpanKind

from ...engine.forward_batch import ForwardBatch, ForwardResult
from .tracing import Tracing, extract, forward_attributes, inject

MAX_STEP_LINKS = 16


class RequestTrace:
    """One request's span (made by the router) and its links to the steps that served it. The links
    are added to the span in batches: when the request has ``MAX_STEP_LINKS`` of them, or when it
    ends (``finish``). The engine loop and the servicer (a client gone away) may both call ``finish``."""

    def __init__(self, span: Span) -> None:
        self.span = span
        self.step_links = 0  # steps linked to it so far
        self._pending: list[SpanContext] = []  # of those, not yet added to the span

    @property
    def linkable(self) -> bool:
        """Whether the next step links to it (and it to the step)."""
        return self.step_links < MAX_STEP_LINKS and self.span.is_recording()

    def link_step(self, step: SpanContext) -> None:
        self._pending.append(step)
        self.step_links += 1
        if self.step_links == MAX_STEP_LINKS:
            self.finish()

    def finish(self) -> None:
        """Add the pending links (idempotent; before the span ends). The list is swapped out, not
        cleared, so that two threads never add one link twice."""
        steps, self._pending = self._pending, []
        if steps and self.span.is_recording():
            for ctx in steps:
                self.span.add_link(ctx)


class StepTracer:
    """The step spans of one engine loop (its thread alone calls ``start`` and ``end``)."""

    def __init__(self, tracing: Tracing, dp_rank: int, in_process: bool) -> None:
        self.tracing = tracing
        self.dp_rank = dp_rank
        self.in_process = in_process  # the step span is the engine's forward span too
        self._name = "modeserve.forward" if in_process else "modeserve.step"
        self._head: RequestTrace | None = None  # the request whose trace the last step span is in

    @property
    def enabled(self) -> bool:
        return self.tracing.enabled

    def start(self, batch: ForwardBatch, traces: Sequence[RequestTrace]) -> tuple[ForwardBatch, Span | None]:
        """The span of a step whose requests' traces are ``traces`` (batch order), and the batch to
        send (a remote engine's carries the span's context). No span when no request is sampled; a
        remote engine then still gets a request's (unsampled) context, so that it samples alike."""
        if not self.tracing.enabled or not traces:
            return batch, None
        head = self._head
        if head is None or not head.span.is_recording() or not any(t is head for t in traces):
            head = self._head = next((t for t in traces if t.span.is_recording()), None)
        if head is None:
            return (batch, None) if self.in_process else (self._with_context(batch, traces[0].span), None)
        others = [t for t in traces if t is not head and t.linkable][:MAX_STEP_LINKS]
        span = self.tracing.start_span(
            self._name, trace.set_span_in_context(head.span), SpanKind.CLIENT,
            [Link(t.span.get_span_context()) for t in others],
            {"modeserve.forward_mode": batch.forward_mode.name, "modeserve.batch_size": batch.batch_size,
             "modeserve.num_tokens": batch.num_tokens, "modeserve.dp_rank": self.dp_rank})
        if not span.is_recording():  # the sampler dropped it: the engine still sees the request's trace
            return (batch, None) if self.in_process else (self._with_context(batch, head.span), None)
        step = span.get_span_context()
        if head.linkable:
            head.link_step(step)
        for t in others:
            t.link_step(step)
        return (batch, span) if self.in_process else (self._with_context(batch, span), span)

    def end(self, span: Span | None, result: ForwardResult, end_time: int | None = None) -> None:
        """End a step's span once its result is in (with the engine in process, with what only the
        engine knows); ``end_time`` in ns since the epoch (None: now)."""
        if span is None:
            return
        if self.in_process:
            span.set_attributes(forward_attributes(result.cuda_graph_bucket, _batch_size(span)))
        span.end(end_time)

    @staticmethod
    def _with_context(batch: ForwardBatch, span: Span) -> ForwardBatch:
        return dataclasses.replace(batch, trace_context=inject(span))


def forward_span(tracing: Tracing, batch: ForwardBatch, dp_rank: int) -> Span | None:
    """The engine server's ``modeserve.forward`` span of a step: a child of the router's step span
    that the batch carries (a root span when it carries none); None when tracing is off or the
    sampler drops it."""
    if not tracing.enabled:
        return None
    span = tracing.start_span(
        "modeserve.forward", extract(batch.trace_context) if batch.trace_context else None, SpanKind.SERVER,
        attributes={"modeserve.forward_mode": batch.forward_mode.name, "modeserve.batch_size": batch.batch_size,
                    "modeserve.num_tokens": batch.num_tokens, "modeserve.dp_rank": dp_rank})
    return span if span.is_recording() else None


def end_forward_span(span: Span | None, result: ForwardResult) -> None:
    if span is not None:
        span.set_attributes(forward_attributes(result.cuda_graph_bucket, _batch_size(span)))
        span.end()


def _batch_size(span: Span) -> int:
    """The batch size a step span was started with (the SDK's spans are readable)."""
    value = (span.attributes or {}).get("modeserve.batch_size") if isinstance(span, ReadableSpan) else None
    return value if isinstance(value, int) else 0
