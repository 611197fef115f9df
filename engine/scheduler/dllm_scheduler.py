"""The scheduler of a block-diffusion model: every step is DLLM_EXTEND (``dllm`` holds the block and its
unmasking rule)."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np

from ..config import SchedulerConfig
from ..forward_batch import ForwardResult
from ..forward_mode import ForwardMode
from ..models.dllm_spec import DllmSpec
from ..request import Req, ReqStatus
from ..sampling_params import SamplingParams
from . import dllm
from .scheduled_step import Item, ReqEvent, Sample, ScheduledStep, extend_arrays
from .scheduler import Scheduler


class _DllmRow(NamedTuple):
    req: Req
    before: int  # whole-block tokens before its current block this step computes (their KV final after it)
    samples: bool  # the row carries the current block (else: a prompt's whole blocks only, over budget)


class DllmScheduler(Scheduler):
    def __init__(self, cfg: SchedulerConfig, num_pages: int, page_size: int, max_context: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], spec: DllmSpec,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        if cfg.speculative_algorithm or cfg.enable_split_prefill or cfg.enable_mixed:
            raise ValueError("a block-diffusion model runs DLLM_EXTEND steps only: speculative decoding, split "
                             "prefill and MIXED steps are for autoregressive models")
        super().__init__(cfg, num_pages, page_size, max_context, vocab_size, eos_token_ids, decode)
        self.spec = spec
        # the block each request's step in flight denoises (its next step needs this one's result)
        self._in_flight: dict[Req, dllm.Block] = {}

    def _check_request(self, rid: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if sampling.logprobs is not None:
            raise ValueError(f"request {rid}: logprobs are not available from a block-diffusion model")
        if (sampling.frequency_penalty, sampling.presence_penalty, sampling.repetition_penalty) != (0.0, 0.0, 1.0):
            raise ValueError(f"request {rid}: penalties are not available with a block-diffusion model")
        size = self.spec.block_size
        if len(prompt_ids) // size * size + size > self.max_context:
            raise ValueError(f"request {rid}: a prompt of {len(prompt_ids)} tokens leaves no room for a block of "
                             f"{size} within max_context {self.max_context}")

    def _schedule(self) -> ScheduledStep | None:
        """A DLLM_EXTEND step: each running request's row is the whole blocks before its current block that
        lack final KV (the prompt's, or the block committed last step), then the current block, which samples;
        a prompt longer than the step's prefill budget runs whole blocks only until the rest fits."""
        self.step_no += 1
        spec = self.spec
        budget = self.cfg.chunked_prefill_size or self.max_context * self.cfg.max_running_requests
        rows: list[_DllmRow] = []
        for req in list(self.running):
            if req in self._in_flight or req.status != ReqStatus.RUNNING:
                continue
            row = self._row(req, budget, preempt=True)
            if row is not None:
                rows.append(row)
                budget -= row.before
        whole = math.lcm(spec.block_size, self.kv.page_size)  # cached KV is reused by whole blocks and pages
        while self.waiting and self.free_slots and budget >= spec.block_size:
            req = self.waiting[0]
            hit = self.kv.match_prefix(req) // whole * whole
            self.kv.shorten_match(req, hit)  # a block's KV needs all of the block
            req.kv_final, req.block = hit, None
            row = self._row(req, budget, preempt=False)
            if row is None:
                self.kv.undo_match(req)
                req.kv_final, req.block = 0, None
                break
            self.waiting.popleft()
            self._admit(req, hit)
            rows.append(row)
            budget -= row.before
        rows = [row for row in rows if row.req.status == ReqStatus.RUNNING]  # a row's KV may have preempted another
        if not rows:
            if self.running and not self._in_flight:  # nothing fits the KV pool: free some
                self._retract(self.running[-1])
                return self._schedule()
            return None
        return self._build_rows(rows)

    def _row(self, req: Req, budget: int, preempt: bool) -> _DllmRow | None:
        """``req``'s row this step, its KV reserved (``preempt``: newer requests preempted for it); None when
        there is no KV for it."""
        spec = self.spec
        if req.block is None:
            req.block = dllm.new_block(req.fill_ids, spec.block_size, spec.mask_token_id)
        start = req.block.start
        before = start - req.kv_final
        if before > max(budget, spec.block_size):  # prefill only: whole blocks
            before = max(budget // spec.block_size, 1) * spec.block_size
            return _DllmRow(req, before, False) if self._reserve(req, req.kv_final + before, preempt) else None
        return _DllmRow(req, before, True) if self._reserve(req, start + spec.block_size, preempt) else None

    def _reserve(self, req: Req, end: int, preempt: bool) -> bool:
        """KV slots of ``req`` up to position ``end``, preempting the newest requests while there are none."""
        while req.num_computed < end and self.kv.alloc(req, end - req.num_computed) is None:
            if not preempt or req.status != ReqStatus.RUNNING:
                return False
            self._retract(self.running[-1])
        return req.status == ReqStatus.RUNNING or not preempt

    def _build_rows(self, rows: list[_DllmRow]) -> ScheduledStep:
        items, samples, ids = [], [], []
        size = self.spec.block_size
        for row in rows:
            req, block = row.req, row.req.block
            assert block is not None
            ids.extend(req.tokens(req.kv_final, req.kv_final + row.before))
            if row.samples:
                ids.extend(block.tokens.tolist())
                samples.append(Sample(req, len(req.output_ids), False))
                self._in_flight[req] = block
            items.append(Item(req, req.kv_final, row.before + (size if row.samples else 0)))
            req.kv_final += row.before
        arrays = extend_arrays(items, ids)
        arrays["sample_mask"] = np.array([row.samples for row in rows], dtype=bool)
        reqs = tuple(row.req for row in rows)
        return ScheduledStep(self._make_batch(ForwardMode.DLLM_EXTEND, reqs, arrays, None), reqs, tuple(samples))

    def process_result(self, step: ScheduledStep, result: ForwardResult) -> list[ReqEvent]:
        """Each sampled block's unmasking (LowConfidence); a block with no mask left commits its tokens after
        the prompt, token by token through the stop checks."""
        if not step.samples:
            return []
        assert result.confidences is not None
        spec = self.spec
        size, events = spec.block_size, []
        tokens, conf = result.next_token_ids, result.confidences
        max_steps = self.cfg.dllm_max_steps_per_block or size
        for i, sample in enumerate(step.samples):
            req = sample.req
            block: dllm.Block | None = req.block
            if self._in_flight.pop(req, None) is not block or block is None or req.status != ReqStatus.RUNNING:
                continue  # aborted or preempted (maybe readmitted: a new block) while the step ran
            masked = int((block.tokens == spec.mask_token_id).sum())
            dllm.low_confidence(block, spec.mask_token_id, tokens[i * size : (i + 1) * size],
                                conf[i * size : (i + 1) * size], self.cfg.dllm_threshold, max_steps)
            self.stats.record_dllm_unmasked(masked - int((block.tokens == spec.mask_token_id).sum()))
            if dllm.is_done(block, spec.mask_token_id):
                events.append(self._commit_block(req, block))
        return events

    def _commit_block(self, req: Req, block: dllm.Block) -> ReqEvent:
        """A block with no mask left: its tokens after the prompt become outputs, through the stop checks;
        the request ends at the context limit if no further block fits."""
        req.block = None
        run: list[int] = []
        for token in block.tokens[max(req.fill_len - block.start, 0):].tolist():
            req.output_ids.append(token)
            run.append(token)
            if self._stop_after(req, len(req.output_ids)):
                break
        size = self.spec.block_size
        if not req.finished and req.fill_len // size * size + size > self.max_context:
            self._release(req)
            self._finish(req, "length")
        return ReqEvent(req, tuple(run), req.finished)

    def _release(self, req: Req) -> None:
        # only final KV is cached: not the current block's, nor the last committed one's
        self.kv.truncate(req, req.kv_final)
        req.block, req.kv_final = None, 0
        self._in_flight.pop(req, None)
        super()._release(req)
