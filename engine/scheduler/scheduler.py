"""The scheduler: queues, admission, chunked prefill, split prefill, the forward mode of each step, preemption.

One step is ``schedule()`` -> (engine runs the ``ForwardBatch``) -> ``process_result()``.
CPU only: it builds numpy arrays, never device tensors. ``speculative_scheduler`` and ``dllm_scheduler``
extend it for speculative decoding and block-diffusion models; ``create_scheduler`` picks one.
"""

from __future__ import annotations

import collections
import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..config import SchedulerConfig
from ..forward_batch import ForwardBatch, ForwardResult, LayerRange, ReqAdmission, SlotUpdate
from ..forward_mode import ForwardMode, determine_forward_mode
from ..request import PLACEHOLDER, FinishReason, Req, ReqStatus
from ..request_limits import RequestLimits, check_prompt
from ..sampling_params import SamplingParams
from .kv_manager import KVManager
from .scheduled_step import Item, ReqEvent, Sample, ScheduledStep, decode_arrays, extend_arrays
from .stats import ForwardModeStats
from .stop import StopChecker

logger = logging.getLogger(__name__)


@dataclass
class _Split:
    """The split prefill in progress: one request's prefill (or chunk), run a slice of layers a step."""

    item: Item
    next_layer: int = 0


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        num_pages: int,
        page_size: int,
        max_context: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        decode: Callable[[list[int]], str] | None = None,
        num_layers: int = 0,
    ) -> None:
        """``num_layers``: the model's decoder layers (split prefill slices them; needed with it on)."""
        if cfg.enable_split_prefill and num_layers < 1:
            raise ValueError("enable_split_prefill needs the model's number of layers (num_layers >= 1)")
        self.cfg = cfg
        self.num_layers = num_layers
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.kv = KVManager(num_pages, page_size, cfg.enable_prefix_cache)
        self.stop = StopChecker(eos_token_ids, max_context, decode)
        self.stats = ForwardModeStats()
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.free_slots = list(range(cfg.max_running_requests - 1, -1, -1))
        self.pending_updates: list[SlotUpdate] = []
        self._admissions: list[ReqAdmission] = []
        self.rng = random.Random(cfg.random_seed)
        self.step_no = 0
        self._split: _Split | None = None
        self._decodes_due = 0  # decode steps before the split's next slice
        self._after_slice = False  # the last step built was a slice (a split starting now waits a decode step)
        self._released: list[int] = []  # slots of split prefills dropped unfinished, for the next batch
        # the request whose last slice is in flight: it decodes once that slice's token is known (a decode
        # step with it would wait for the slice, and the step loop may read later steps' results first)
        self._slicing: Req | None = None

    # ---- requests -------------------------------------------------------------------------
    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(max_context=self.max_context, vocab_size=self.vocab_size,
                             kv_capacity_tokens=self.kv.capacity_tokens, max_new_tokens=None,
                             max_prompt_chars=64 * self.max_context)

    def make_request(self, rid: str, prompt_ids: list[int], sampling: SamplingParams) -> Req:
        """Check and build a request (``ValueError`` on bad input; nothing is queued)."""
        try:
            check_prompt(prompt_ids, sampling.max_new_tokens, self.limits)
        except ValueError as exc:
            raise ValueError(f"request {rid}: {exc}") from exc
        self._check_request(rid, prompt_ids, sampling)
        seed = sampling.seed if sampling.seed is not None else self.rng.getrandbits(63)
        return Req(rid=rid, prompt_ids=list(prompt_ids), sampling=sampling, seed=seed)

    def _check_request(self, rid: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """What this scheduler's model refuses beyond the limits every request has (``ValueError``)."""

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> Req | None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, "abort")
                return req
        for req in self.running:
            if req.rid == rid:
                self._release(req)
                self._finish(req, "abort")
                return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self, idle_if_empty: bool = False) -> ScheduledStep | None:
        """Choose this step's requests and mode. With nothing to run: None, or an IDLE batch when
        ``idle_if_empty`` (a lockstep DP rank must still take part in every step)."""
        step = self._schedule()
        if step is None and idle_if_empty:
            batch = ForwardBatch.idle(self.step_no)
            self.stats.record(ForwardMode.IDLE, 0, 0)
            if logger.isEnabledFor(logging.INFO):
                logger.info(self.stats.log_line(self.step_no, ForwardMode.IDLE, 0, 0))
            return ScheduledStep(batch, ())
        return step

    def _schedule(self) -> ScheduledStep | None:
        self.step_no += 1
        decodes, verifies = self._decoders()
        extends: list[Item] = []
        chunk = self.cfg.chunked_prefill_size or self.max_context * self.cfg.max_running_requests
        if self._split is not None:
            return self._split_turn(decodes, verifies)
        can_prefill = bool(self.waiting) or any(not r.prefill_done for r in self.running)
        if can_prefill and (decodes or verifies) and self.cfg.enable_split_prefill:
            step = self._start_split(chunk, decodes, verifies)
            if step is not None:
                return step
        if can_prefill and decodes and self.cfg.enable_mixed:
            budget = min(chunk, self._mixed_prefill_cap(len(decodes)))
            if budget >= 1:
                decodes = self._reserve_decode(decodes)
                extends = self._take_prefill(budget, keep_free_pages=0)
                return self._build(extends, decodes)
        if can_prefill:
            extends = self._take_prefill(chunk, keep_free_pages=len(decodes))
            if extends:
                return self._build(extends, [])
        step = self._decode_step(decodes, verifies)
        if step is not None:
            return step
        if any(not r.prefill_done for r in self.running):
            # Only partial prefills remain and none can grow: free memory by preempting the newest.
            self._retract(self.running[-1])
            return self._schedule()
        return None

    def _decoders(self) -> tuple[list[Req], list[Req]]:
        """The running requests that may take a DECODE step, and those that may take a TARGET_VERIFY step."""
        decodes = [r for r in self.running if r.prefill_done and self._may_decode(r) and r is not self._slicing]
        return decodes, decodes

    # ---- split prefill --------------------------------------------------------------------------
    def _start_split(self, chunk: int, decodes: list[Req], verifies: list[Req]) -> ScheduledStep | None:
        """The first slice of a split prefill, if the next prefill is long enough to split (a short one
        taken after a prefix hit runs as an EXTEND step); None: prefill as without split prefill."""
        partial = [r for r in self.running if not r.prefill_done]
        nxt = partial[0] if partial else self.waiting[0]
        need = min(nxt.fill_len - nxt.num_computed, chunk)
        if need < self.cfg.split_prefill_min_tokens:
            return None
        items = self._take_prefill(need, keep_free_pages=len(decodes), max_items=1)
        if not items:
            return None
        if items[0].length < self.cfg.split_prefill_min_tokens:
            return self._build(items, [])
        self._split = _Split(items[0])
        # the decoders' turns between two splits' slices too
        self._decodes_due = self.cfg.split_prefill_decode_steps if self._after_slice else 0
        return self._split_turn(decodes, verifies)

    def _split_turn(self, decodes: list[Req], verifies: list[Req]) -> ScheduledStep | None:
        """While a split prefill runs: ``split_prefill_decode_steps`` decode (or verify) steps and the split's
        next slice by turns; the slice's layers: ``split_prefill_token_budget`` // its tokens, all that are
        left with nothing decoding."""
        split = self._split
        assert split is not None
        if self._decodes_due > 0 and (decodes or verifies):
            self._decodes_due -= 1
            step = self._decode_step(decodes, verifies)
            if step is not None:
                return step
            if self._split is None:  # the decode step's KV preempted the split
                return self._schedule()
        self._decodes_due = self.cfg.split_prefill_decode_steps
        per = max(1, self.cfg.split_prefill_token_budget // split.item.length) if decodes or verifies else self.num_layers
        layers = LayerRange(split.next_layer, min(split.next_layer + per, self.num_layers))
        split.next_layer = layers.end
        if layers.end == self.num_layers:
            self._split, self._slicing = None, split.item.req
        return self._build([split.item], [], split_layers=layers)

    def _decode_step(self, decodes: list[Req], verifies: list[Req]) -> ScheduledStep | None:
        """The running requests' next token: a DECODE step (``verifies``: for a scheduler that speculates)."""
        return self._build([], self._reserve_decode(decodes)) if decodes else None

    def _may_decode(self, req: Req) -> bool:
        """False once the tokens sampled so far (incl. in flight) reach a length limit."""
        return len(req.output_ids) < req.sampling.max_new_tokens and req.fill_len < self.max_context

    def _mixed_prefill_cap(self, num_decodes: int) -> int:
        ratio = self.cfg.max_prefill_ratio
        if ratio >= 1.0:
            return self.max_context * self.cfg.max_running_requests
        return math.floor(ratio / (1.0 - ratio) * num_decodes + 1e-9)

    def _take_prefill(self, budget: int, keep_free_pages: int, max_items: int | None = None) -> list[Item]:
        items: list[Item] = []
        for req in [r for r in self.running if not r.prefill_done][:max_items]:
            n = min(req.fill_len - req.num_computed, budget)
            if n <= 0 or self.kv.alloc(req, n, keep_free_pages) is None:
                return items
            items.append(Item(req, req.num_computed - n, n))
            budget -= n
        while self.waiting and budget > 0 and self.free_slots and (max_items is None or len(items) < max_items):
            req = self.waiting[0]
            if PLACEHOLDER in req.output_ids[-1:]:
                break  # its last token is still in flight; readmit once it is known
            hit = self.kv.match_prefix(req)
            n = min(req.fill_len - req.num_computed, budget)
            if self.kv.alloc(req, n, keep_free_pages) is None:
                self.kv.undo_match(req)
                break
            self.waiting.popleft()
            self._admit(req, hit)
            items.append(Item(req, req.num_computed - n, n))
            budget -= n
        return items

    def _admit(self, req: Req, hit: int) -> None:
        req.req_pool_idx = self.free_slots.pop()
        req.status = ReqStatus.RUNNING
        req.prefill_done = False
        self.running.append(req)
        if req.num_retractions == 0:
            req.num_cached_prompt_tokens = hit
        self.stats.num_prefix_hit_tokens += hit
        self._admissions.append(ReqAdmission(req.req_pool_idx, req.sampling, req.seed, len(req.prompt_ids)))
        if hit:
            locs = np.asarray(req.kv_locs[:hit], dtype=np.int64)
            ids = np.asarray(req.tokens(0, hit), dtype=np.int64)
            self.pending_updates.append(SlotUpdate(req.req_pool_idx, 0, locs, ids))

    def _reserve_decode(self, decodes: list[Req], lengths: list[int] | None = None) -> list[Req]:
        """One KV slot per decoding request (``lengths``: so many), oldest first; retract the newest
        when memory runs out."""
        ready: list[Req] = []
        for req, n in zip(decodes, lengths or [1] * len(decodes)):
            while req.status == ReqStatus.RUNNING and self.kv.alloc(req, n) is None:
                self._retract(self.running[-1])
            if req.status == ReqStatus.RUNNING:
                ready.append(req)
        return [r for r in ready if r.status == ReqStatus.RUNNING]

    def _retract(self, req: Req) -> None:
        """Preempt ``req``: free its KV (prefix kept in the cache) and requeue it for recomputation."""
        logger.info("retracting request %s (%d tokens) to free KV", req.rid, req.fill_len)
        self._release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.stats.num_retractions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Req) -> None:
        if req is self._slicing:  # its KV slots go to others only after its last slice ran
            self._slicing = None
            self._released.append(req.req_pool_idx)
        elif self._split is not None and self._split.item.req is req:  # the engine drops its hidden state too
            self._split = None
            self._released.append(req.req_pool_idx)
        self.kv.release(req)
        self.running.remove(req)
        self.free_slots.append(req.req_pool_idx)
        req.req_pool_idx = -1
        req.prefill_done = False

    def _build(self, extends: list[Item], decodes: list[Req],
               split_layers: LayerRange | None = None) -> ScheduledStep | None:
        """The step's batch; with ``split_layers`` a SPLIT_PREFILL slice of ``extends``, which samples after
        the last layer only."""
        if not extends and not decodes:
            return None
        if not extends:
            return self._emit(ForwardMode.DECODE, tuple(decodes), decode_arrays(decodes), None)
        mode = ForwardMode.SPLIT_PREFILL if split_layers is not None else determine_forward_mode(len(extends),
                                                                                                len(decodes))
        arrays = extend_arrays(extends + [Item(r, r.num_computed - 1, 1) for r in decodes])
        if split_layers is not None and split_layers.end < self.num_layers:
            arrays["sample_mask"][:] = False
        return self._emit(mode, tuple([it.req for it in extends] + decodes), arrays, split_layers)

    def _emit(self, mode: ForwardMode, reqs: tuple[Req, ...], arrays: dict[str, Any],
              split_layers: LayerRange | None) -> ScheduledStep:
        """The step of ``reqs`` (batch order): a placeholder output for each row that samples."""
        batch = self._make_batch(mode, reqs, arrays, split_layers)
        samples = []
        for req, sampled in zip(reqs, batch.sample_mask.tolist()):
            if sampled:
                samples.append(Sample(req, len(req.output_ids), not req.prefill_done))
                req.output_ids.append(PLACEHOLDER)
                req.prefill_done = True
        return ScheduledStep(batch, reqs, tuple(samples))

    def _make_batch(self, mode: ForwardMode, reqs: tuple[Req, ...], arrays: dict[str, Any],
                    split_layers: LayerRange | None) -> ForwardBatch:
        """The batch of ``reqs`` with ``arrays`` (its array fields) and what the engine must apply first
        (admissions, slot updates, released slots); counted in the per-mode stats."""
        batch = ForwardBatch(
            forward_mode=mode,
            req_pool_indices=np.array([r.req_pool_idx for r in reqs], dtype=np.int64),
            admissions=tuple(self._admissions),
            slot_updates=tuple(self.pending_updates),
            step=self.step_no,
            split_layers=split_layers,
            released_slots=tuple(self._released),
            **arrays,
        )
        self._admissions.clear()
        self.pending_updates.clear()
        self._released.clear()
        self._after_slice = split_layers is not None
        # a split prefill's tokens count once, with its first slice
        self.stats.record(mode, batch.batch_size, batch.num_tokens if not split_layers or not split_layers.begin else 0)
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s | running=%d waiting=%d", self.stats.log_line(self.step_no, mode, batch.batch_size,
                                                                        batch.num_tokens),
                        len(self.running), len(self.waiting))
        return batch

    # ---- results --------------------------------------------------------------------------
    def process_result(self, step: ScheduledStep, result: ForwardResult) -> list[ReqEvent]:
        """Put each sampled token in its placeholder, check stops, release finished requests.

        With overlap the next step may already be scheduled: a request can hold a further
        placeholder, which is dropped if this token finishes it.
        """
        events: list[ReqEvent] = []
        tokens = result.next_token_ids.tolist()  # Python ints at once, not a numpy scalar per row
        for i, sample in enumerate(step.samples):
            req = sample.req
            if req is self._slicing:
                self._slicing = None
            if req.finished:
                continue  # aborted (or finished by an earlier in-flight step)
            token = tokens[i]
            req.output_ids[sample.output_index] = token
            if sample.first and req.status == ReqStatus.RUNNING:
                update = self.kv.cache_prefix(req)
                if update is not None:
                    self.pending_updates.append(update)
            self._record_logprobs(req, result, i)
            self._stop_after(req, sample.output_index + 1)
            events.append(ReqEvent(req, (token,), req.finished))
        return events

    def _stop_after(self, req: Req, num_outputs: int) -> bool:
        """Finish ``req`` if output ``num_outputs - 1`` stops it (the outputs after it dropped, its KV
        released); whether it did."""
        reason = self.stop.check(req, num_outputs)
        if reason is None:
            return False
        del req.output_ids[num_outputs:]
        if req.status == ReqStatus.RUNNING:
            self._release(req)
        else:
            self.waiting.remove(req)
        self._finish(req, reason)
        return True

    def _record_logprobs(self, req: Req, result: ForwardResult, row: int) -> None:
        if result.logprobs is None or req.sampling.logprobs is None:
            return
        req.output_logprobs.append(float(result.logprobs[row]))
        n = req.sampling.logprobs
        if n and result.top_logprob_ids is not None and result.top_logprob_values is not None:
            req.output_top_logprobs.append(
                list(zip(result.top_logprob_ids[row, :n].tolist(), result.top_logprob_values[row, :n].tolist()))
            )

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
