"""Warm an engine up before it serves: two throwaway requests, stepped through a scheduler of their own
over the engine's runner, so that the first real prefill, paged chunk or MIXED step does not load its
kernels (FlashInfer's JIT modules, Triton's specialisations) while other requests wait on it. SGLang's
server sends a warm-up request for the same reason.

One request prefills in small chunks, so its first chunk starts a sequence and the later ones read a
cached prefix, then decodes. The other arrives while the first decodes, so its chunks are MIXED steps
where ``enable_mixed`` is on, or SPLIT_PREFILL slices where split prefill is on. Their scheduler has no
prefix cache and its own KV page accounting, so the engine's scheduler later finds the whole pool free.
The runner's KV pages and request slots are written by the warm-up and rewritten by real requests; its
CUDA graphs' replay counts start again from zero after it."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

from .config import EngineConfig
from .forward_batch import ForwardBatch
from .models.model_config import ModelConfig
from .runner.model_runner import ModelRunner
from .sampling_params import SamplingParams
from .scheduler.create import create_scheduler
from .scheduler.scheduled_step import ScheduledStep
from .scheduler.scheduler import Scheduler
from .scheduler_steps import SchedulerSteps
from .step_loop import StepLoop

logger = logging.getLogger(__name__)

NEW_TOKENS = 8  # the first request still decodes while the second one's four chunks run beside it


class _CountedSteps(SchedulerSteps):
    """Counts the forward mode of every step, and whether an EXTEND step read a cached prefix (a MIXED step
    always does: its decodes')."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler, lambda _events: None)
        self.modes: Counter[str] = Counter()

    def next_step(self, idle: bool) -> ScheduledStep | None:
        step = super().next_step(idle)
        if step is not None:
            batch = step.batch
            paged = batch.forward_mode.name == "EXTEND" and bool(batch.prefix_lens.any())
            self.modes[batch.forward_mode.name + (" (cached prefix)" if paged else "")] += 1
        return step


def warm_up(runner: ModelRunner, config: EngineConfig, model: ModelConfig) -> Counter[str]:
    """Run the warm-up on ``runner``; the steps it ran, by forward mode (EXTEND steps that read a cached
    prefix apart: "EXTEND (cached prefix)"). Nothing runs (an empty count) where the KV pool or the
    context cannot hold both requests."""
    page = config.runner.page_size
    chunk = max(2 * page, 32)
    lens = (3 * chunk - 3, 3 * chunk + 5)  # not whole pages, not multiples of 16
    # one decoding request leaves a MIXED step no prefill tokens under a max_prefill_ratio below 1; a chunk
    # is split into slices only if it is split_prefill_min_tokens long
    cfg = dataclasses.replace(config.scheduler, chunked_prefill_size=chunk, enable_prefix_cache=False,
                              max_prefill_ratio=1.0,
                              split_prefill_min_tokens=min(config.scheduler.split_prefill_min_tokens, chunk))
    need = sum(-(-(n + NEW_TOKENS) // page) + 1 for n in lens)
    if max(lens) + NEW_TOKENS > runner.max_context or need > runner.num_pages - 1:
        logger.info("warm-up skipped: %d KV pages or a context of %d tokens hold less than its two requests",
                    runner.num_pages, runner.max_context)
        return Counter()
    scheduler = create_scheduler(cfg, num_pages=runner.num_pages, page_size=page, max_context=runner.max_context,
                                 vocab_size=model.vocab_size, eos_token_ids=(), num_layers=model.num_layers,
                                 dllm_spec=runner.dllm)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [scheduler.make_request(f"warm-up-{i}", [(7 * t + 3 * i + 1) % model.vocab_size for t in range(n)], sampling)
            for i, n in enumerate(lens)]
    scheduler.add_request(reqs[0])
    steps = _CountedSteps(scheduler)
    beside = config.runner.enable_split_prefill_overlap
    loop = StepLoop(steps, runner, 1, scheduler.stats, ForwardBatch.is_slice if beside else None)
    loop.run(lambda: len(reqs[0].output_ids) > 0)  # the first request decodes from here on
    scheduler.add_request(reqs[1])
    loop.run(lambda: all(r.finished for r in reqs))
    runner.reset_graph_stats()
    logger.info("warm-up ran %s", dict(steps.modes))
    return steps.modes
