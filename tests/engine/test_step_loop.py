"""The step loop with a scripted executor: results in launch order, at most ``max_in_flight`` launched
ahead, and deferred steps (a split prefill's last slice) overtaken by the later steps' results until done."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from modeserve.engine.forward_batch import ForwardBatch, ForwardResult
from modeserve.engine.forward_mode import ForwardMode
from modeserve.engine.scheduler.stats import ForwardModeStats
from modeserve.engine.step_loop import StepLoop


@dataclass(frozen=True)
class _Step:
    batch: ForwardBatch
    name: str


class _Pending:
    def __init__(self, name: str, log: list[str], ready_after: int) -> None:
        self.name, self.log, self.ready_after = name, log, ready_after

    def done(self) -> bool:  # ready once so many other results were read
        return sum(e.startswith("result") for e in self.log) >= self.ready_after

    def result(self) -> ForwardResult:
        self.log.append(f"result {self.name}")
        return ForwardResult(next_token_ids=np.zeros(0, dtype=np.int64))


class _Script:
    """Source and executor: steps named by mode; ``slow``: steps whose result is ready only after so many
    other results were read."""

    def __init__(self, modes: list[ForwardMode], slow: dict[int, int] | None = None) -> None:
        self.todo = [_Step(ForwardBatch.idle(i) if m == ForwardMode.IDLE else _batch(m, i), f"{m.name}{i}")
                     for i, m in enumerate(modes)]
        self.slow = slow or {}
        self.log: list[str] = []
        self.in_flight = 0
        self.max_seen = 0

    def next_step(self, idle: bool) -> _Step | None:
        return self.todo.pop(0) if self.todo else None

    def launch(self, batch: ForwardBatch) -> _Pending:
        self.log.append(f"launch {batch.step}")
        self.in_flight += 1
        self.max_seen = max(self.max_seen, self.in_flight)
        return _Pending(str(batch.step), self.log, self.slow.get(batch.step, 0))

    def process(self, step: _Step, result: ForwardResult) -> None:
        self.in_flight -= 1
        self.log.append(f"process {step.name}")


def _batch(mode: ForwardMode, step: int) -> ForwardBatch:
    one = np.ones(1, dtype=np.int64)
    return ForwardBatch(forward_mode=mode, req_pool_indices=np.zeros(1, dtype=np.int64), prefix_lens=one,
                        extend_lens=one, sample_mask=np.ones(1, dtype=bool), positions=one, input_ids=one,
                        out_cache_loc=one, step=step)


def _processed(script: _Script) -> list[str]:
    return [e.removeprefix("process ") for e in script.log if e.startswith("process")]


def _is_slice(batch: ForwardBatch) -> bool:
    return batch.forward_mode == ForwardMode.SPLIT_PREFILL


MODES = [ForwardMode.DECODE, ForwardMode.SPLIT_PREFILL] + [ForwardMode.DECODE] * 4


def test_results_in_launch_order_without_defer() -> None:
    script = _Script(MODES, slow={1: 4})
    stats = ForwardModeStats()
    StepLoop(script, script, 2, stats).run(lambda: not script.todo)
    assert _processed(script) == [f"{m.name}{i}" for i, m in enumerate(MODES)]
    assert script.max_seen == 2
    # each step timed once, by its mode
    assert {m: sum(n) for m, n in stats.mode_time_buckets.items()} == {"DECODE": 5, "SPLIT_PREFILL": 1}


def test_a_deferred_step_is_overtaken_until_done() -> None:
    script = _Script(MODES, slow={1: 3})  # the slice is done after three other results
    stats = ForwardModeStats()
    StepLoop(script, script, 2, stats, defer=_is_slice).run(lambda: not script.todo)
    assert _processed(script) == ["DECODE0", "DECODE2", "DECODE3", "SPLIT_PREFILL1", "DECODE4", "DECODE5"]
    # the deferred step does not count in max_in_flight: two decodes beside it
    assert script.max_seen == 3
    assert {m: sum(n) for m, n in stats.mode_time_buckets.items()} == {"DECODE": 5, "SPLIT_PREFILL": 1}


def test_the_loop_waits_for_a_deferred_step_before_it_ends() -> None:
    script = _Script([ForwardMode.DECODE, ForwardMode.SPLIT_PREFILL, ForwardMode.DECODE], slow={1: 99})
    StepLoop(script, script, 2, ForwardModeStats(), defer=_is_slice).run(lambda: not script.todo)
    assert _processed(script) == ["DECODE0", "DECODE2", "SPLIT_PREFILL1"]
    assert script.in_flight == 0


def test_a_done_deferred_step_keeps_its_place() -> None:
    script = _Script(MODES)  # every result ready at once: nothing overtakes
    StepLoop(script, script, 2, ForwardModeStats(), defer=_is_slice).run(lambda: not script.todo)
    assert _processed(script) == [f"{m.name}{i}" for i, m in enumerate(MODES)]
