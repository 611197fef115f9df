"""The step loop: take a step → launch it → (up to ``max_in_flight`` launched) → wait → process.

``LLM.generate``, each router rank and the engine server all drive this one loop. What differs is
the ``StepSource`` (a scheduler, or a stream of batches from a router) and the ``Executor`` behind
``launch`` (the model runner in this process, or a gRPC stream to an engine). Overlap is carrying the
launched steps into the next iteration: step N+1 is built and launched before step N's result is
read, and a batch may refer to tokens not sampled yet (placeholders the engine resolves). A step the
loop is told to ``defer`` (a split prefill's slice, beside the decode steps) is waited for only once
nothing else is in flight: until it is done, later steps' results overtake its, so the host never
waits for a slice while decode steps can go on.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, replace
from typing import Callable, Generic, Protocol, TypeVar

from .forward_batch import ForwardBatch, ForwardResult
from .scheduler.stats import ForwardModeStats


class PendingStep(Protocol):
    """A launched step; ``result()`` waits for it (never for later steps)."""

    def result(self) -> ForwardResult: ...

    def done(self) -> bool:
        """Whether ``result()`` would return at once."""


class Executor(Protocol):
    """Runs batches in launch order; ``launch`` returns at once. ``ModelRunner`` is one (the model in this
    process: the step is queued on the device, or on a CPU run inside ``launch``)."""

    def launch(self, batch: ForwardBatch) -> PendingStep: ...


class Step(Protocol):
    @property
    def batch(self) -> ForwardBatch: ...


StepT = TypeVar("StepT", bound=Step)


class StepSource(Protocol[StepT]):
    def next_step(self, idle: bool) -> StepT | None:
        """The next step to launch, or None if there is none now. ``idle``: nothing is in flight, so
        a source that waits for work may block here (briefly: the loop checks ``stop`` between calls)."""

    def process(self, step: StepT, result: ForwardResult) -> None:
        """The step's result, in launch order (a deferred step's: when done, maybe after later steps')."""


@dataclass(frozen=True)
class _Launched(Generic[StepT]):
    step: StepT
    pending: PendingStep
    at: float
    seq: int  # launch order


class StepLoop(Generic[StepT]):
    """Steps of one source through one executor. A step's time counts from when it could start: its
    launch, or the previous step's result if that came later (steps in flight run one after another);
    it is recorded once, into ``stats``, and handed on as ``ForwardResult.forward_seconds``."""

    def __init__(self, source: StepSource[StepT], executor: Executor, max_in_flight: int,
                 stats: ForwardModeStats, defer: Callable[[ForwardBatch], bool] | None = None) -> None:
        """``defer``: the batches whose results later steps' may overtake; the source must need no such
        result to build or process other steps, and the executor's results must not depend on the order
        they are read in (in this process, not over a stream). They do not count in ``max_in_flight``."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.source = source
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.stats = stats
        self.defer = defer
        self._in_flight: collections.deque[_Launched[StepT]] = collections.deque()
        self._deferred: collections.deque[_Launched[StepT]] = collections.deque()
        self._last_result = time.perf_counter()
        self._launches = 0

    def run(self, stop: Callable[[], bool]) -> None:
        """Until ``stop()`` and nothing is in flight (steps launched before ``stop()`` still finish)."""
        in_flight, deferred = self._in_flight, self._deferred
        while True:
            if deferred and (not in_flight or deferred[0].seq < in_flight[0].seq) and deferred[0].pending.done():
                self._finish(deferred.popleft(), overtaken=True)
            stopping = stop()
            if not stopping and len(in_flight) < self.max_in_flight:
                step = self.source.next_step(idle=not in_flight and not deferred)
                if step is not None:
                    self._launches += 1
                    launched = _Launched(step, self.executor.launch(step.batch), time.perf_counter(), self._launches)
                    (deferred if self.defer is not None and self.defer(step.batch) else in_flight).append(launched)
                    continue
            if in_flight:
                self._finish(in_flight.popleft())
            elif deferred:
                self._finish(deferred.popleft(), overtaken=True)
            elif stopping:
                return

    def _finish(self, launched: _Launched[StepT], overtaken: bool = False) -> None:
        result = launched.pending.result()
        now = time.perf_counter()
        if overtaken:  # it ran beside the others: from its launch
            seconds = now - launched.at
        else:
            seconds = now - max(launched.at, self._last_result)
            self._last_result = now
        self.stats.add_time(launched.step.batch.forward_mode, seconds)
        self.source.process(launched.step, replace(result, forward_seconds=seconds))
