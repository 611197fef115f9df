"""Where the host's time of an in-process engine's steps goes: the engine's own step loop over its
scheduler and model runner, with each phase timed on the loop's thread (perf counter): schedule (build
the next batch), launch (the runner queues it on the device: uploads, plans, kernel launches), wait (the
loop blocked on a result; on a GPU, the device still running) and process (the scheduler takes the
result). With overlap a step's launch runs while the one before it is on the device, so a step whose
launch + schedule + process exceed its device time is bound by the host and its wait is near zero."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ...engine.forward_batch import ForwardBatch, ForwardResult
from ...engine.scheduler.scheduled_step import ScheduledStep
from ...engine.step_loop import PendingStep

PHASES = ("schedule", "launch", "wait", "process")


@dataclass
class PhaseTimes:
    schedule: float = 0.0  # seconds, summed over the steps
    launch: float = 0.0
    wait: float = 0.0
    process: float = 0.0
    steps: int = 0

    def per_step_us(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {p: round(getattr(self, p) * 1e6 / n, 1) for p in PHASES}


class _TimedPending:
    def __init__(self, pending: PendingStep, times: PhaseTimes) -> None:
        self._pending, self._times = pending, times

    def result(self) -> ForwardResult:
        start = time.perf_counter()
        try:
            return self._pending.result()
        finally:
            self._times.wait += time.perf_counter() - start

    def done(self) -> bool:
        return self._pending.done()


class _TimedSteps:
    """The scheduler as the loop's source and the runner as its executor, each call timed."""

    def __init__(self, llm: Any, times: PhaseTimes) -> None:
        self._scheduler, self._runner, self._times = llm.scheduler, llm.runner, times

    def next_step(self, idle: bool) -> ScheduledStep | None:
        start = time.perf_counter()
        step: ScheduledStep | None = self._scheduler.schedule()
        self._times.schedule += time.perf_counter() - start
        if step is None and idle and not self._scheduler.has_work:
            raise RuntimeError("scheduler stalled with unfinished requests")
        return step

    def launch(self, batch: ForwardBatch) -> _TimedPending:
        start = time.perf_counter()
        pending = self._runner.launch(batch)
        self._times.launch += time.perf_counter() - start
        self._times.steps += 1
        return _TimedPending(pending, self._times)

    def process(self, step: ScheduledStep, result: ForwardResult) -> None:
        start = time.perf_counter()
        self._scheduler.process_result(step, result)
        self._times.process += time.perf_counter() - start


def run_timed(llm: Any, done: Callable[[], bool]) -> PhaseTimes:
    """``llm.run_until(done)`` (its overlap, its stats), with the host's time split by phase."""
    times = PhaseTimes()
    steps = _TimedSteps(llm, times)
    llm.step_loop(steps, steps).run(done)
    return times
