"""A split prefill's slices beside the decode steps (``enable_split_prefill_overlap``): the step loop
reads the decodes' results before a slice's while it is not done. On CPU every result is ready at once,
so an executor in front of the runner holds each slice's result back for a few launches: the outputs
stay those of transformers, no decode step carries a request before its first token is known, and an
abort while the last slice is out frees everything and fences its KV slots."""

from __future__ import annotations

from pathlib import Path

from modeserve.engine import LLM
from modeserve.engine.forward_batch import ForwardBatch, ForwardResult
from modeserve.engine.forward_mode import ForwardMode
from modeserve.engine.request import PLACEHOLDER, Req
from modeserve.engine.runner.host_io import PendingResult
from modeserve.engine.scheduler.scheduled_step import ScheduledStep
from modeserve.engine.step_loop import PendingStep
from tests.engine.test_split_prefill import (GREEDY, LONG, NEW_TOKENS, SHORT, SHORT_GREEDY, SHORT_TOKENS, SPLIT, _idle,
                                             mixed_workload, tiny_llama_4)
from tests.engine.tiny_models import load_reference, reference_greedy

__all__ = ["tiny_llama_4"]  # the fixture

HOLD = 5  # launches after a slice before its result is done (two decode steps go first)


class _Late:
    def __init__(self, pending: PendingResult[ForwardResult], executor: _LateSlices) -> None:
        self._pending, self._executor = pending, executor
        self._ready_at = executor.launches + HOLD

    def done(self) -> bool:
        return self._executor.launches >= self._ready_at

    def result(self) -> ForwardResult:
        return self._pending.result()


class _LateSlices:
    """The runner, with each slice's result done only ``HOLD`` launches after it."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.runner
        self.launches = 0

    def launch(self, batch: ForwardBatch) -> PendingStep:
        self.launches += 1
        pending = self.runner.launch(batch)
        if batch.is_slice():
            return _Late(pending, self)
        return pending


class _Steps:
    """The scheduler as the source; records the order of launches and results by step number."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.launched: list[tuple[int, ForwardMode]] = []
        self.processed: list[int] = []
        self.last_slices = 0
        self.before_first_token: list[str] = []  # requests in a decode step before their first token

    def next_step(self, idle: bool) -> ScheduledStep | None:
        step = self.llm.scheduler.schedule()
        if step is not None:
            self.launched.append((step.batch.step, step.batch.forward_mode))
            self.last_slices += step.batch.is_slice() and bool(step.batch.sample_mask.any())
            if step.batch.forward_mode == ForwardMode.DECODE:
                self.before_first_token += [r.rid for r in step.reqs if r.output_ids[0] == PLACEHOLDER]
        return step

    def process(self, step: ScheduledStep, result: ForwardResult) -> None:
        self.processed.append(step.batch.step)
        self.llm.scheduler.process_result(step, result)

    def overtaken(self) -> int:
        """Slices whose result was read after a later step's."""
        order = {s: i for i, s in enumerate(self.processed)}
        return sum(any(order[later] < order[s] for later, _ in self.launched if later > s)
                   for s, mode in self.launched if mode == ForwardMode.SPLIT_PREFILL and s in order)


def _llm(folder: Path) -> LLM:
    return LLM(model=str(folder), page_size=4, kv_cache_tokens=4096, enable_split_prefill_overlap=True, **SPLIT)


def _run(llm: LLM, steps: _Steps, reqs: list[Req]) -> None:
    llm.step_loop(steps, _LateSlices(llm)).run(lambda: all(r.finished for r in reqs))


def test_decodes_overtake_the_slices_and_outputs_equal_transformers(tiny_llama_4: Path) -> None:
    llm = _llm(tiny_llama_4)
    steps = _Steps(llm)
    outputs = mixed_workload(llm, SHORT, LONG, lambda done: llm.step_loop(steps, _LateSlices(llm)).run(done))
    ref = load_reference(tiny_llama_4)
    assert outputs == ([reference_greedy(ref, p, SHORT_TOKENS) for p in SHORT]
                       + [reference_greedy(ref, p, NEW_TOKENS) for p in LONG])
    slices = sum(mode == ForwardMode.SPLIT_PREFILL for _, mode in steps.launched)
    assert steps.last_slices == len(LONG) and slices > len(LONG)
    assert steps.overtaken() == slices  # each a later step's result went first
    assert steps.before_first_token == []
    assert _idle(llm) and llm.runner.split.held_slots == ()


def test_abort_while_the_last_slice_is_out_frees_everything(tiny_llama_4: Path) -> None:
    llm = _llm(tiny_llama_4)
    first = [llm.make_request(p, SHORT_GREEDY) for p in SHORT]
    long = llm.make_request(LONG[3], GREEDY)
    for r in first:
        llm.add_request(r)
    llm.run_until(lambda: all(len(r.output_ids) >= 2 for r in first))
    llm.add_request(long)
    released: list[tuple[int, ...]] = []

    class _AbortAfterLastSlice(_Steps):
        def next_step(self, idle: bool) -> ScheduledStep | None:
            if long.output_ids[:1] == [PLACEHOLDER] and not long.finished:  # its last slice is out
                slot = long.req_pool_idx
                assert llm.abort(long.rid)
                step = super().next_step(idle)
                assert step is not None
                released.append((slot, *step.batch.released_slots))
                return step
            return super().next_step(idle)

    _run(llm, _AbortAfterLastSlice(llm), [*first, long])
    assert len(released) == 1 and released[0][0] in released[0][1:]  # the next batch fences its slots
    assert long.finish_reason == "abort"
    ref = load_reference(tiny_llama_4)
    assert [list(r.output_ids) for r in first] == [reference_greedy(ref, p, SHORT_TOKENS) for p in SHORT]
    assert _idle(llm) and llm.runner.split.held_slots == ()
