"""The engine's own step loop with each token stamped with the time its step's result was read (when a
client could have had it), and a request that arrives between two steps once a condition holds."""

from __future__ import annotations

import bisect
import time
from collections import Counter, defaultdict
from typing import Any, Callable

from ...engine.forward_batch import ForwardResult
from ...engine.request import Req
from ...engine.scheduler.scheduled_step import ScheduledStep


class TimedSteps:
    """``LLM``'s scheduler as a step source (overlap as ``LLM.run_until`` has it); records token times
    and the mode of every step by the time its result was read."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.token_times: dict[str, list[float]] = defaultdict(list)  # rid -> the time of each output token
        self.step_modes: list[tuple[float, str]] = []  # (result read, forward mode) of every step
        self._arrival: tuple[Callable[[], bool], Req] | None = None
        self.arrived_at = 0.0

    def arrive(self, req: Req, when: Callable[[], bool]) -> None:
        """``req`` is added before the first step scheduled after ``when()`` holds (``arrived_at``)."""
        self._arrival = (when, req)

    def run(self, stop: Callable[[], bool]) -> None:
        """Step until ``stop()`` (and nothing is in flight)."""
        self.llm.step_loop(self).run(stop)

    def modes_between(self, begin: float, end: float = float("inf")) -> dict[str, int]:
        """The steps whose result was read in (begin, end], by forward mode."""
        return dict(Counter(m for t, m in self.step_modes if begin < t <= end))

    def tokens_since(self, rid: str, since: float) -> int:
        times = self.token_times[rid]
        return len(times) - bisect.bisect_left(times, since)

    def next_step(self, idle: bool) -> ScheduledStep | None:
        if self._arrival is not None and self._arrival[0]():
            self.llm.add_request(self._arrival[1])
            self.arrived_at, self._arrival = time.perf_counter(), None
        step: ScheduledStep | None = self.llm.scheduler.schedule()
        if step is None and idle:
            raise RuntimeError("the scheduler has nothing to run before the bench's stop condition")
        return step

    def process(self, step: ScheduledStep, result: ForwardResult) -> None:
        now = time.perf_counter()
        self.step_modes.append((now, step.batch.forward_mode.name))
        for event in self.llm.scheduler.process_result(step, result):
            self.token_times[event.req.rid].extend([now] * len(event.new_token_ids))


def gaps_overlapping(times: list[float], begin: float, end: float) -> list[float]:
    """The gaps between consecutive ``times`` that overlap [begin, end] (the one a stall ends in included)."""
    return [b - a for a, b in zip(times, times[1:]) if b > begin and a < end]


def gaps_within(times: list[float], begin: float, end: float) -> list[float]:
    """The gaps between consecutive ``times`` that lie inside [begin, end]."""
    return [b - a for a, b in zip(times, times[1:]) if a >= begin and b <= end]
