"""``LLM``: the offline Python API — build the engine once, then ``generate`` batches of prompts."""

from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .builder import build_engine
from .forward_batch import ForwardBatch
from .request import Req
from .sampling_params import SamplingParams
from .scheduler.create import create_scheduler
from .scheduler.scheduled_step import ReqEvent, ScheduledStep
from .scheduler_steps import SchedulerSteps
from .step_loop import Executor, StepLoop, StepSource
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    """An in-process engine: scheduler + model runner on one device.

    ``LLM(model=None)`` loads the embedded default model (SmolLM2-135M-Instruct, GGUF).
    Keyword arguments are the fields of ``RunnerConfig`` and ``SchedulerConfig``. With ``overlap``
    ``generate`` schedules and launches step N+1 before it reads step N's tokens.
    """

    def __init__(self, model: str | Path | None = None, progress: Callable[[str], None] | None = None,
                 overlap: bool = True, **kwargs: Any) -> None:
        self.overlap = overlap
        parts = build_engine(model, progress, exit_on_tp_loss=False, **kwargs)
        self.config, self.model_config = parts.config, parts.checkpoint.config
        self.tp_workers = parts.tp_workers  # a tensor-parallel engine's other ranks: they stop with it
        self._close = weakref.finalize(self, parts.tp_workers.close) if parts.tp_workers is not None else None
        self.tokenizer: Tokenizer | None = parts.tokenizer
        self.runner = parts.runner
        self.scheduler = create_scheduler(
            self.config.scheduler,
            num_pages=self.runner.num_pages,
            page_size=self.config.runner.page_size,
            max_context=self.runner.max_context,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=parts.eos_token_ids,
            decode=self._decode if self.tokenizer is not None else None,
            num_layers=self.model_config.num_layers,
            dllm_spec=self.runner.dllm,
        )
        self._ids = itertools.count()

    # ---- request level ------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of prompts")
        return self.tokenizer.apply_chat_template(prompt) if chat else self.tokenizer.encode(prompt)

    def make_request(self, prompt_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None) -> Req:
        return self.scheduler.make_request(rid or f"req-{next(self._ids)}", list(prompt_ids), sampling)

    def add_request(self, req: Req) -> None:
        self.scheduler.add_request(req)

    def abort(self, rid: str) -> bool:
        return self.scheduler.abort(rid) is not None

    def step(self) -> list[ReqEvent]:
        """Run one scheduler step and one forward; the events of the requests that advanced."""
        events: list[ReqEvent] = []
        source = SchedulerSteps(self.scheduler, events.extend, once=True)
        StepLoop(source, self.runner, 1, self.scheduler.stats).run(lambda: source.done)
        return events

    def output_of(self, req: Req) -> RequestOutput:
        text = self._decode(req.output_ids, req.sampling.skip_special_tokens) if self.tokenizer else ""
        if req.matched_stop is not None and req.matched_stop in text:
            text = text[: text.index(req.matched_stop)]
        return RequestOutput(req.rid, req.prompt_ids, list(req.output_ids), text, req.finish_reason,
                             list(req.output_logprobs), list(req.output_top_logprobs), req.num_cached_prompt_tokens)

    # ---- batch API ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in input order."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        token_lists = [self.encode(p, chat) for p in prompts] if prompts is not None else [list(p) for p in prompt_token_ids or []]
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(token_lists)
        else:
            params = list(sampling_params)
            if len(params) != len(token_lists):
                raise ValueError(f"{len(params)} sampling params for {len(token_lists)} prompts")
        reqs = [self.make_request(ids, sp) for ids, sp in zip(token_lists, params)]  # validate all first
        for req in reqs:
            self.add_request(req)
        self.run_until(lambda: all(r.finished for r in reqs))
        return [self.output_of(r) for r in reqs]

    def run_until(self, done: Callable[[], bool]) -> None:
        """Step until ``done()``; with overlap one step stays in flight while the next is prepared."""
        self.step_loop(SchedulerSteps(self.scheduler, lambda _events: None)).run(done)

    def step_loop(self, source: StepSource[ScheduledStep], executor: Executor | None = None) -> StepLoop[ScheduledStep]:
        """The step loop of ``source`` on this engine (``executor``: in front of its runner): with overlap one
        step in flight while the next is prepared, and a split prefill's slices, which run beside the decode
        steps (``enable_split_prefill_overlap``), read when done rather than before their results."""
        beside = self.overlap and self.config.runner.enable_split_prefill_overlap
        return StepLoop(source, executor or self.runner, 2 if self.overlap else 1, self.scheduler.stats,
                        ForwardBatch.is_slice if beside else None)

    def stats(self) -> dict[str, Any]:
        return self.scheduler.stats.get_stats()

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks (nothing to do with one rank)."""
        if self._close is not None:
            self._close()

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
