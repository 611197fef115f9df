"""``StepSpan``: the span of one step, without the SDK's per-span machinery.

A step span is made for every step, a thousand a second on a small model, and the SDK's span (locks,
attribute cleaning, bounded containers, a processor call at start, a ``ReadableSpan`` copy at end)
cost more per step than the rest of tracing together. A ``StepSpan`` is itself the ``ReadableSpan``
that processors and exporters get: ``Tracing.start_step_span`` makes it (once the sampler samples
it), ``end`` hands it to the span processor. Its attribute values are plain ``str``/``int``/``bool``
and nothing is dropped; one thread at a time touches it (an in-process engine sets its attributes
before the step's result comes back, ``end`` comes after). Imported only when tracing is on.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind


class StepSpan(ReadableSpan):
    def __init__(self, processor: SpanProcessor, resource: Resource, scope: InstrumentationScope, name: str,
                 context: SpanContext, parent: SpanContext, kind: SpanKind, links: Sequence[Link],
                 attributes: dict[str, Any]) -> None:
        super().__init__(name, context, parent, resource, attributes, (), links, kind, start_time=time.time_ns(),
                         instrumentation_scope=scope)
        self._processor = processor

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self._attributes.update(attributes)  # type: ignore[union-attr]

    def end(self) -> None:
        """Once."""
        self._end_time = time.time_ns()
        self._processor.on_end(self)

    # nothing is dropped (the SDK's properties ask whether the containers are bounded ones)
    @property
    def dropped_attributes(self) -> int:
        return 0

    @property
    def dropped_events(self) -> int:
        return 0

    @property
    def dropped_links(self) -> int:
        return 0
