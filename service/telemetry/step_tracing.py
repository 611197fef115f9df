"""The spans of steps: the router's ``modeserve.step`` (or, with the engine in its process, the one
``modeserve.forward``) span of each step, and the engine server's ``modeserve.forward`` span.

A step serves many requests but a span has one parent: the step span is a child of one sampled
request's span (the *head*: the previous step's while it is still served and recording, so a decode
stays in one trace), and links to the step's other requests; each request span links back to the
step spans. A request and each of its first ``MAX_STEP_LINKS`` steps link to each other; later steps
add no links, so a long decode's spans stay small. The router's step span travels to a remote engine
as ``ForwardBatch.trace_context``; the engine's forward span is its child. Spans are records here
(``span_record``): starting and ending one costs a few microseconds of the loop's thread.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from opentelemetry.trace import SpanContext, SpanKind

from ...engine.forward_batch import ForwardBatch, ForwardResult
from ...engine.forward_mode import ForwardMode
from .span_record import SpanRecord
from .tracing import Tracing, extract, inject

MAX_STEP_LINKS = 16


class RequestTrace:
    """One request's span (the router's) and its links to the first ``MAX_STEP_LINKS`` steps that
    served it. The rank loop links steps; the servicer sets attributes and ends it (also when the
    client went away, while a step may still link to it)."""

    def __init__(self, tracing: Tracing, record: SpanRecord) -> None:
        self.tracing = tracing
        self.record = record
        self.linkable = record.recording  # whether the next step links to it (and it to the step)

    @property
    def context(self) -> SpanContext:
        return self.record.context

    @property
    def recording(self) -> bool:
        return self.record.recording

    @property
    def step_links(self) -> int:
        return len(self.record.links)

    def link_step(self, step: SpanContext) -> None:
        self.record.links.append(step)
        self.linkable = len(self.record.links) < MAX_STEP_LINKS

    def end(self, error: str | None = None) -> None:
        """End the span (again: nothing), failed with the status ``error`` when given."""
        self.linkable = False
        if error is not None:
            self.record.set_error(error)
        self.tracing.end(self.record)


class StepTracer:
    """The step spans of one engine loop (its thread alone calls ``start`` and ``end``)."""

    def __init__(self, tracing: Tracing, dp_rank: int, in_process: bool) -> None:
        self.tracing = tracing
        self.dp_rank = dp_rank
        self.in_process = in_process  # the step span is the engine's forward span too
        self._name = "modeserve.forward" if in_process else "modeserve.step"
        self._head: RequestTrace | None = None  # the request whose trace the last step span is in
        # the last ``traces`` in which none could link (a caller reuses a list while its steps serve the same requests)
        self._unlinkable: Sequence[RequestTrace] | None = None

    @property
    def enabled(self) -> bool:
        return self.tracing.enabled

    def start(self, batch: ForwardBatch, traces: Sequence[RequestTrace]) -> tuple[ForwardBatch, SpanRecord | None]:
        """The span of a step whose requests' traces are ``traces`` (batch order), and the batch to
        send (a remote engine's carries the span's context). No span when no request is sampled; a
        remote engine then still gets a request's (unsampled) context, so that it samples alike."""
        if not self.tracing.enabled or not traces:
            return batch, None
        head = self._head
        if head is None or not head.record.recording or head not in traces:
            head = self._head = next((t for t in traces if t.record.recording), None)
        if head is None:
            return (batch, None) if self.in_process else (self._with_context(batch, traces[0].context), None)
        others = [] if traces is self._unlinkable else [t for t in traces if t.linkable and t is not head][:MAX_STEP_LINKS]
        if not others and not head.linkable:  # and so it stays (a trace never becomes linkable again)
            self._unlinkable = traces
        span = self.tracing.start_child(self._name, head.record, SpanKind.CLIENT, step_attributes(batch, self.dp_rank),
                                        [t.context for t in others])
        if head.linkable:
            head.link_step(span.context)
        for t in others:
            t.link_step(span.context)
        return (batch, span) if self.in_process else (self._with_context(batch, span.context), span)

    def end(self, span: SpanRecord | None, result: ForwardResult, end_time: int | None = None) -> None:
        """End a step's span once its result is in (with the engine in process, with what only the
        engine knows); ``end_time`` in ns since the epoch (None: now)."""
        if span is not None and self.in_process:
            end_forward_span(self.tracing, span, result, end_time)
        elif span is not None:
            _add_accepted(span, result)
            self.tracing.end(span, end_time)

    @staticmethod
    def _with_context(batch: ForwardBatch, context: SpanContext) -> ForwardBatch:
        return dataclasses.replace(batch, trace_context=inject(context))


def step_attributes(batch: ForwardBatch, dp_rank: int) -> dict[str, Any]:
    """A step span's attributes; a TARGET_VERIFY step's also say how many drafts it carries, a
    SPLIT_PREFILL step's which layers it runs."""
    attrs: dict[str, Any] = {"modeserve.forward_mode": batch.forward_mode.name, "modeserve.batch_size": batch.batch_size,
                             "modeserve.num_tokens": batch.num_tokens, "modeserve.dp_rank": dp_rank}
    if batch.forward_mode == ForwardMode.TARGET_VERIFY:
        attrs["modeserve.spec.draft_tokens"] = batch.num_tokens - batch.batch_size
    if batch.split_layers is not None:  # a SPLIT_PREFILL slice: layers [begin, end)
        attrs["modeserve.split.layer_begin"], attrs["modeserve.split.layer_end"] = batch.split_layers
    return attrs


def _add_accepted(span: SpanRecord, result: ForwardResult) -> None:
    """A verify step's span: how many of its drafts the target kept."""
    if result.accepted_lengths is not None:
        span.attributes["modeserve.spec.accepted_tokens"] = int(result.accepted_lengths.sum())


def forward_span(tracing: Tracing, batch: ForwardBatch, dp_rank: int) -> SpanRecord | None:
    """The engine server's ``modeserve.forward`` span of a step: a child of the router's step span
    that the batch carries (a root span when it carries none); None when tracing is off or the
    sampler drops it."""
    if not tracing.enabled:
        return None
    span = tracing.start("modeserve.forward", extract(batch.trace_context) if batch.trace_context else None,
                         SpanKind.SERVER, step_attributes(batch, dp_rank))
    return span if span.recording else None


def end_forward_span(tracing: Tracing, span: SpanRecord | None, result: ForwardResult, end_time: int | None = None) -> None:
    """End a forward span with what only the engine knows: whether it replayed a CUDA graph, padded to what."""
    if span is not None:
        bucket = result.cuda_graph_bucket
        span.attributes.update({"modeserve.cuda_graph": bucket is not None, "modeserve.padded_batch_size":
                                bucket if bucket is not None else span.attributes["modeserve.batch_size"]})
        _add_accepted(span, result)
        tracing.end(span, end_time)
