"""How a rank picks its next step: free-running (as soon as it has one, several in flight), or in
lockstep with the other ranks (one at a time, agreed each round: a rank without work runs IDLE and a
CUDA-graph step is padded to the bucket every rank replays)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

from ...engine.scheduler.scheduled_step import ScheduledStep
from ...engine.scheduler.scheduler import Scheduler
from .lockstep import LockstepGroup, StepOffer

Wait = Callable[[float], None]  # sleep up to this many seconds, unless woken by new work or a stop


class StepPolicy(Protocol):
    max_in_flight: int

    def next_step(self, scheduler: Scheduler, idle: bool, wait: Wait) -> ScheduledStep | None: ...

    def leave(self) -> None: ...


class FreeRunning:
    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight

    def next_step(self, scheduler: Scheduler, idle: bool, wait: Wait) -> ScheduledStep | None:
        step = scheduler.schedule()
        if step is None and idle:
            wait(0.05)
        return step

    def leave(self) -> None:
        pass


class Lockstep:
    """One member of ``group``. A step taken from the scheduler is held until its round is agreed (the
    group may need several calls: the loop checks for a stop between them)."""

    max_in_flight = 1

    def __init__(self, group: LockstepGroup, name: str, graph_batch_sizes: Sequence[int]) -> None:
        self.group = group
        self.name = name
        self.graph_batch_sizes = sorted(graph_batch_sizes)
        self._offered: tuple[ScheduledStep | None] | None = None  # the step of the open round
        group.join(name)

    def next_step(self, scheduler: Scheduler, idle: bool, wait: Wait) -> ScheduledStep | None:
        if self._offered is None:
            self._offered = (scheduler.schedule(),)
        step = self._offered[0]
        agreement = self.group.exchange(self.name, StepOffer(step is not None, self._graph_rows(step)))
        if agreement is None:
            return None
        self._offered = None
        if not agreement.any_work:
            wait(0.02)
            return None
        if step is None:
            step = scheduler.schedule(idle_if_empty=True)
            assert step is not None
        return dataclasses.replace(step, batch=dataclasses.replace(
            step.batch, padded_batch_size=agreement.padded_batch_size))

    def _graph_rows(self, step: ScheduledStep | None) -> int:
        """Rows this step would replay in a CUDA graph (0 when idle), -1 if it runs eagerly."""
        if step is None:
            return 0
        batch = step.batch
        if not batch.forward_mode.traits.uses_cuda_graph or not self.graph_batch_sizes:
            return -1
        return batch.batch_size if batch.batch_size <= self.graph_batch_sizes[-1] else -1

    def leave(self) -> None:
        self.group.leave(self.name)
