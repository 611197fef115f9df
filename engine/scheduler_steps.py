"""The scheduler as a step loop's source in this process (``LLM``'s), where the router's
remote schedulers feed engines over gRPC instead."""

from __future__ import annotations

from typing import Callable

from .forward_batch import ForwardResult
from .scheduler.scheduled_step import ReqEvent, ScheduledStep
from .scheduler.scheduler import Scheduler


class SchedulerSteps:
    """The scheduler as the step loop's source, in this process; ``once``: a single step."""

    def __init__(self, scheduler: Scheduler, on_events: Callable[[list[ReqEvent]], None], once: bool = False) -> None:
        self.scheduler = scheduler
        self.on_events = on_events
        self.once = once
        self.done = False

    def next_step(self, idle: bool) -> ScheduledStep | None:
        if self.done:
            return None
        step = self.scheduler.schedule()
        self.done = self.once
        if step is None and idle and not self.once and not self.scheduler.has_work:
            raise RuntimeError("scheduler stalled with unfinished requests")
        return step

    def process(self, step: ScheduledStep, result: ForwardResult) -> None:
        self.on_events(self.scheduler.process_result(step, result))
