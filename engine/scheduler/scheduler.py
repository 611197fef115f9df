"""The scheduler: queues, admission, chunked prefill, split prefill, the forward mode of each step, preemption.

One step is ``schedule()`` -> (engine runs the ``ForwardBatch``) -> ``process_result()``.
CPU only: it builds numpy arrays, never device tensors.
"""

from __future__ import annotations

import collections
import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from ..config import SchedulerConfig
from ..forward_batch import ForwardBatch, ForwardResult, LayerRange, ReqAdmission, SlotUpdate
from ..forward_mode import ForwardMode, determine_forward_mode
from ..request import PLACEHOLDER, FinishReason, Req, ReqStatus
from ..request_limits import RequestLimits, check_prompt
from ..sampling_params import SamplingParams
from ..models.dllm_spec import DllmSpec
from . import dllm
from .kv_manager import KVManager
from .speculative import make_drafter, record_draft_steps, verify_arrays
from .stats import ForwardModeStats
from .stop import StopChecker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Item:
    req: Req
    start: int  # first position computed this step
    length: int  # tokens computed this step


@dataclass
class _Split:
    """The split prefill in progress: one request's prefill (or chunk), run a slice of layers a step."""

    item: _Item
    next_layer: int = 0


class _DllmRow(NamedTuple):
    req: Req
    before: int  # whole-block tokens before its current block this step computes (their KV final after it)
    samples: bool  # the row carries the current block (else: a prompt's whole blocks only, over budget)


class _Sample(NamedTuple):  # one per request per step: a tuple is made faster than a frozen dataclass
    req: Req
    output_index: int  # where the sampled token goes in req.output_ids (a placeholder until then)
    first: bool  # the request's first sample since (re)admission: its prompt is now computed


@dataclass(frozen=True)
class ScheduledStep:
    batch: ForwardBatch
    reqs: tuple[Req, ...]  # batch order
    samples: tuple[_Sample, ...] = ()  # rows with sample_mask set, in batch order


@dataclass(frozen=True)
class ReqEvent:
    """What one step produced for one request."""

    req: Req
    new_token_ids: tuple[int, ...]
    finished: bool


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
        dllm_spec: DllmSpec | None = None,
    ) -> None:
        """``num_layers``: the model's decoder layers (split prefill slices them; needed with it on).
        ``dllm_spec``: a block-diffusion model's block (its requests run DLLM_EXTEND steps only)."""
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
        self.drafter = make_drafter(cfg, max_context)
        # per request, the drafts of each of its TARGET_VERIFY steps in flight (two: the second chained)
        self._verifying: dict[Req, list[int]] = {}
        self._split: _Split | None = None
        self._decodes_due = 0  # decode steps before the split's next slice
        self._after_slice = False  # the last step built was a slice (a split starting now waits a decode step)
        self._released: list[int] = []  # slots of split prefills dropped unfinished, for the next batch
        self.dllm = dllm_spec
        # the block each request's step in flight denoises (its next step needs this one's result)
        self._dllm_in_flight: dict[Req, dllm.Block] = {}
        if dllm_spec is not None and (cfg.speculative_algorithm or cfg.enable_split_prefill or cfg.enable_mixed):
            raise ValueError("a block-diffusion model runs DLLM_EXTEND steps only: speculative decoding, split "
                             "prefill and MIXED steps are for autoregressive models")

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
        if self.dllm is not None:
            self._check_dllm_request(rid, prompt_ids, sampling, self.dllm)
        seed = sampling.seed if sampling.seed is not None else self.rng.getrandbits(63)
        return Req(rid=rid, prompt_ids=list(prompt_ids), sampling=sampling, seed=seed)

    def _check_dllm_request(self, rid: str, prompt_ids: list[int], sampling: SamplingParams, spec: DllmSpec) -> None:
        if sampling.logprobs is not None:
            raise ValueError(f"request {rid}: logprobs are not available from a block-diffusion model")
        if (sampling.frequency_penalty, sampling.presence_penalty, sampling.repetition_penalty) != (0.0, 0.0, 1.0):
            raise ValueError(f"request {rid}: penalties are not available with a block-diffusion model")
        if len(prompt_ids) // spec.block_size * spec.block_size + spec.block_size > self.max_context:
            raise ValueError(f"request {rid}: a prompt of {len(prompt_ids)} tokens leaves no room for a block of "
                             f"{spec.block_size} within max_context {self.max_context}")

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
        if self.dllm is not None:
            return self._schedule_dllm(self.dllm)
        decodes = [r for r in self.running if r.prefill_done and self._may_decode(r)]
        verifies = decodes
        if self.drafter is not None:  # a request whose step is in flight verifies again only chained
            verifies = [r for r in decodes if PLACEHOLDER not in r.output_ids[-1:] or self._may_chain(r)]
            decodes = [r for r in decodes if PLACEHOLDER not in r.output_ids[-1:]]
        extends: list[_Item] = []
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
            self._split = None
        return self._build([split.item], [], split_layers=layers)

    def _decode_step(self, decodes: list[Req], verifies: list[Req]) -> ScheduledStep | None:
        """The running requests' next token: a TARGET_VERIFY step with a drafter, else a DECODE step."""
        if verifies and self.drafter is not None:
            return self._build_verify(verifies)
        return self._build([], self._reserve_decode(decodes)) if decodes else None

    # ---- block diffusion ------------------------------------------------------------------------
    def _schedule_dllm(self, spec: DllmSpec) -> ScheduledStep | None:
        """A DLLM_EXTEND step: each running request's row is the whole blocks before its current block that
        lack final KV (the prompt's, or the block committed last step), then the current block, which samples;
        a prompt longer than the step's prefill budget runs whole blocks only until the rest fits."""
        budget = self.cfg.chunked_prefill_size or self.max_context * self.cfg.max_running_requests
        rows: list[_DllmRow] = []
        for req in list(self.running):
            if req in self._dllm_in_flight or req.status != ReqStatus.RUNNING:
                continue
            row = self._dllm_row(req, spec, budget, preempt=True)
            if row is not None:
                rows.append(row)
                budget -= row.before
        whole = math.lcm(spec.block_size, self.kv.page_size)  # cached KV is reused by whole blocks and pages
        while self.waiting and self.free_slots and budget >= spec.block_size:
            req = self.waiting[0]
            hit = self.kv.match_prefix(req) // whole * whole
            self.kv.shorten_match(req, hit)  # a block's KV needs all of the block
            req.kv_final, req.block = hit, None
            row = self._dllm_row(req, spec, budget, preempt=False)
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
            if self.running and not self._dllm_in_flight:  # nothing fits the KV pool: free some
                self._retract(self.running[-1])
                return self._schedule()
            return None
        return self._build_dllm(rows, spec)

    def _dllm_row(self, req: Req, spec: DllmSpec, budget: int, preempt: bool) -> _DllmRow | None:
        """``req``'s row this step, its KV reserved (``preempt``: newer requests preempted for it); None when
        there is no KV for it."""
        if req.block is None:
            req.block = dllm.new_block(req.fill_ids, spec.block_size, spec.mask_token_id)
        start = req.block.start
        before = start - req.kv_final
        if before > max(budget, spec.block_size):  # prefill only: whole blocks
            before = max(budget // spec.block_size, 1) * spec.block_size
            return _DllmRow(req, before, False) if self._dllm_reserve(req, req.kv_final + before, preempt) else None
        ok = self._dllm_reserve(req, start + spec.block_size, preempt)
        return _DllmRow(req, before, True) if ok else None

    def _dllm_reserve(self, req: Req, end: int, preempt: bool) -> bool:
        """KV slots of ``req`` up to position ``end``, preempting the newest requests while there are none."""
        while req.num_computed < end and self.kv.alloc(req, end - req.num_computed) is None:
            if not preempt or req.status != ReqStatus.RUNNING:
                return False
            self._retract(self.running[-1])
        return req.status == ReqStatus.RUNNING or not preempt

    def _build_dllm(self, rows: list[_DllmRow], spec: DllmSpec) -> ScheduledStep:
        items, samples, ids = [], [], []
        for row in rows:
            req, block = row.req, row.req.block
            assert block is not None
            ids.extend(req.tokens(req.kv_final, req.kv_final + row.before))
            if row.samples:
                ids.extend(block.tokens.tolist())
                samples.append(_Sample(req, len(req.output_ids), False))
                self._dllm_in_flight[req] = block
            items.append(_Item(req, req.kv_final, row.before + (spec.block_size if row.samples else 0)))
            req.kv_final += row.before
        arrays = self._extend_arrays(items, ids)
        arrays["sample_mask"] = np.array([row.samples for row in rows], dtype=bool)
        batch = ForwardBatch(
            forward_mode=ForwardMode.DLLM_EXTEND,
            req_pool_indices=np.array([row.req.req_pool_idx for row in rows], dtype=np.int64),
            admissions=tuple(self._admissions), slot_updates=tuple(self.pending_updates), step=self.step_no, **arrays)
        self._admissions.clear()
        self.pending_updates.clear()
        self.stats.record(ForwardMode.DLLM_EXTEND, batch.batch_size, batch.num_tokens)
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s | running=%d waiting=%d", self.stats.log_line(self.step_no, ForwardMode.DLLM_EXTEND,
                                                                        batch.batch_size, batch.num_tokens),
                        len(self.running), len(self.waiting))
        return ScheduledStep(batch, tuple(row.req for row in rows), tuple(samples))

    def _process_dllm(self, step: ScheduledStep, result: ForwardResult, spec: DllmSpec) -> list[ReqEvent]:
        """Each sampled block's unmasking (LowConfidence); a block with no mask left commits its tokens after
        the prompt, token by token through the stop checks."""
        if not step.samples:
            return []
        assert result.confidences is not None
        size, events = spec.block_size, []
        tokens, conf = result.next_token_ids, result.confidences
        max_steps = self.cfg.dllm_max_steps_per_block or size
        for i, sample in enumerate(step.samples):
            req = sample.req
            block: dllm.Block | None = req.block
            if self._dllm_in_flight.pop(req, None) is not block or block is None or req.status != ReqStatus.RUNNING:
                continue  # aborted or preempted (maybe readmitted: a new block) while the step ran
            masked = int((block.tokens == spec.mask_token_id).sum())
            dllm.low_confidence(block, spec.mask_token_id, tokens[i * size : (i + 1) * size],
                                conf[i * size : (i + 1) * size], self.cfg.dllm_threshold, max_steps)
            self.stats.record_dllm_unmasked(masked - int((block.tokens == spec.mask_token_id).sum()))
            if dllm.is_done(block, spec.mask_token_id):
                events.append(self._commit_block(req, block, spec))
        return events

    def _commit_block(self, req: Req, block: dllm.Block, spec: DllmSpec) -> ReqEvent:
        """A block with no mask left: its tokens after the prompt become outputs, through the stop checks;
        the request ends at the context limit if no further block fits."""
        req.block = None
        run: list[int] = []
        for token in block.tokens[max(req.fill_len - block.start, 0):].tolist():
            req.output_ids.append(token)
            run.append(token)
            if self._stop_after(req, len(req.output_ids)):
                break
        if not req.finished and req.fill_len // spec.block_size * spec.block_size + spec.block_size > self.max_context:
            self._release(req)
            self._finish(req, "length")
        return ReqEvent(req, tuple(run), req.finished)

    def _may_chain(self, req: Req) -> bool:
        """Whether ``req``'s next verify step may be built now, while its last one (its only step in flight)
        runs: n-gram drafts, and context for the case that step keeps all its drafts."""
        assert self.drafter is not None
        in_flight = self._verifying.get(req, [])
        return (self.drafter.chains and len(in_flight) == 1 and req.output_ids[-1:] == [PLACEHOLDER]
                and req.fill_len + in_flight[0] + self.drafter.k <= self.max_context)

    def _may_decode(self, req: Req) -> bool:
        """False once the tokens sampled so far (incl. in flight) reach a length limit."""
        return len(req.output_ids) < req.sampling.max_new_tokens and req.fill_len < self.max_context

    def _mixed_prefill_cap(self, num_decodes: int) -> int:
        ratio = self.cfg.max_prefill_ratio
        if ratio >= 1.0:
            return self.max_context * self.cfg.max_running_requests
        return math.floor(ratio / (1.0 - ratio) * num_decodes + 1e-9)

    def _take_prefill(self, budget: int, keep_free_pages: int, max_items: int | None = None) -> list[_Item]:
        items: list[_Item] = []
        for req in [r for r in self.running if not r.prefill_done][:max_items]:
            n = min(req.fill_len - req.num_computed, budget)
            if n <= 0 or self.kv.alloc(req, n, keep_free_pages) is None:
                return items
            items.append(_Item(req, req.num_computed - n, n))
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
            items.append(_Item(req, req.num_computed - n, n))
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
        if self._split is not None and self._split.item.req is req:  # the engine drops its hidden state
            self._split = None
            self._released.append(req.req_pool_idx)
        if self.dllm is not None:  # only final KV is cached: not the current block's, nor the last committed one's
            self.kv.truncate(req, req.kv_final)
            req.block, req.kv_final = None, 0
            self._dllm_in_flight.pop(req, None)
        self.kv.release(req)
        self.running.remove(req)
        self.free_slots.append(req.req_pool_idx)
        req.req_pool_idx = -1
        req.prefill_done = False

    def _build(self, extends: list[_Item], decodes: list[Req], drafts: list[list[int]] | None = None,
               chained: list[bool] | None = None, split_layers: LayerRange | None = None) -> ScheduledStep | None:
        """The step's batch; with ``drafts`` (one list a decode) a TARGET_VERIFY step, in which one
        placeholder a request stands for the run of tokens it emits (``chained``: the requests whose
        last verify step is still in flight, ``verify_arrays``); with ``split_layers`` a SPLIT_PREFILL
        slice of ``extends``, which samples after the last layer only."""
        if not extends and not decodes:
            return None
        mode = determine_forward_mode(len(extends), len(decodes))
        if drafts is not None:
            mode = ForwardMode.TARGET_VERIFY
        elif split_layers is not None:
            mode = ForwardMode.SPLIT_PREFILL
        reqs = tuple([it.req for it in extends] + decodes)
        arrays: dict[str, Any]  # ForwardBatch's array fields
        if drafts is not None:
            ahead = [self._verifying[r][0] if c else 0 for r, c in zip(decodes, chained or [False] * len(decodes))]
            arrays = verify_arrays(decodes, drafts, ahead)
            for r, d in zip(decodes, drafts):
                self._verifying.setdefault(r, []).append(len(d))
        elif extends:
            arrays = self._extend_arrays(extends + [_Item(r, r.num_computed - 1, 1) for r in decodes])
            if split_layers is not None and split_layers.end < self.num_layers:
                arrays["sample_mask"][:] = False
        else:  # a decode step (one step a few milliseconds, every request in it): plain lists
            pos = [r.num_computed - 1 for r in decodes]
            arrays = {"prefix_lens": np.array(pos, dtype=np.int64), "extend_lens": np.ones(len(pos), dtype=np.int64),
                      "sample_mask": np.ones(len(pos), dtype=bool), "positions": np.array(pos, dtype=np.int64),
                      "input_ids": np.array([r.tokens(p, p + 1)[0] for r, p in zip(decodes, pos)], dtype=np.int64),
                      "out_cache_loc": np.array([r.kv_locs[-1] for r in decodes], dtype=np.int64)}
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
        samples = []
        for req, sampled in zip(reqs, batch.sample_mask.tolist()):
            if sampled:
                samples.append(_Sample(req, len(req.output_ids), not req.prefill_done))
                req.output_ids.append(PLACEHOLDER)
                req.prefill_done = True
        # a split prefill's tokens count once, with its first slice
        self.stats.record(mode, batch.batch_size, batch.num_tokens if not split_layers or not split_layers.begin else 0)
        if self.cfg.speculative_algorithm == "draft":
            record_draft_steps(self.stats, batch)
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s | running=%d waiting=%d", self.stats.log_line(self.step_no, mode, batch.batch_size,
                                                                        batch.num_tokens),
                        len(self.running), len(self.waiting))
        return ScheduledStep(batch, reqs, tuple(samples))

    def _build_verify(self, decodes: list[Req]) -> ScheduledStep | None:
        """A TARGET_VERIFY step: each decoding request's last token and its drafts (a plain DECODE step,
        which replays CUDA graphs, when no request has a draft)."""
        drafter = self.drafter
        assert drafter is not None
        chain = {r for r in decodes if PLACEHOLDER in r.output_ids[-1:]}  # the engine drafts for these
        proposals = {r: [PLACEHOLDER] * drafter.k if r in chain else drafter.propose(r) for r in decodes}
        if not any(proposals.values()):
            return self._build([], self._reserve_decode(decodes))
        proposals = {r: d if r in chain else drafter.fill(r, d) for r, d in proposals.items()}
        reqs = self._reserve_decode(decodes, [1 + len(proposals[r]) for r in decodes])
        drafts = [proposals[r] for r in reqs]
        step = self._build([], reqs, drafts, [r in chain for r in reqs])
        if step is not None:
            self.stats.spec_verify_steps += 1
            self.stats.spec_draft_tokens += sum(map(len, drafts))
            self.stats.spec_chained_rows += sum(r in chain for r in reqs)
        return step

    @staticmethod
    def _extend_arrays(items: list[_Item], input_ids: list[int] | None = None) -> dict[str, Any]:
        """The arrays of a step computing ``items``; their tokens' ids, or ``input_ids`` where given (a
        DLLM_EXTEND step's blocks hold masks, not the request's tokens)."""
        ids: list[int] = []
        locs: list[int] = []
        for it in items:
            end = it.start + it.length
            if input_ids is None:
                ids.extend(it.req.tokens(it.start, end))
            locs.extend(it.req.kv_locs[it.start : end])
        ids = ids if input_ids is None else input_ids
        prefix = np.fromiter((it.start for it in items), dtype=np.int64, count=len(items))
        ext = np.fromiter((it.length for it in items), dtype=np.int64, count=len(items))
        return {"prefix_lens": prefix, "extend_lens": ext,
                "sample_mask": np.fromiter((it.start + it.length == it.req.fill_len for it in items), dtype=bool,
                                           count=len(items)),
                "positions": np.concatenate([np.arange(p, p + e, dtype=np.int64) for p, e in zip(prefix, ext)]),
                "input_ids": np.asarray(ids, dtype=np.int64), "out_cache_loc": np.asarray(locs, dtype=np.int64)}

    # ---- results --------------------------------------------------------------------------
    def process_result(self, step: ScheduledStep, result: ForwardResult) -> list[ReqEvent]:
        """Put each sampled token in its placeholder, check stops, release finished requests.

        With overlap the next step may already be scheduled: a request can hold a further
        placeholder, which is dropped if this token finishes it.
        """
        if step.batch.forward_mode == ForwardMode.TARGET_VERIFY:
            return self._process_verify(step, result)
        if self.dllm is not None:
            return self._process_dllm(step, result, self.dllm)
        events: list[ReqEvent] = []
        tokens = result.next_token_ids.tolist()  # Python ints at once, not a numpy scalar per row
        for i, sample in enumerate(step.samples):
            req = sample.req
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

    def _process_verify(self, step: ScheduledStep, result: ForwardResult) -> list[ReqEvent]:
        """Each request's placeholder becomes its run (kept drafts + the target's token after them),
        token by token through the stop checks; the KV of what it did not keep goes back first, so only
        kept tokens are ever cached."""
        assert result.accepted_lengths is not None
        events: list[ReqEvent] = []
        tokens = result.next_token_ids.tolist()
        ext = step.batch.extend_lens.tolist()
        start = 0
        for sample, kept, length in zip(step.samples, result.accepted_lengths.tolist(), ext):
            req, first_row = sample.req, start
            start += length
            in_flight = self._verifying.pop(req)
            if len(in_flight) > 1:  # a chained step of req's is in flight still
                self._verifying[req] = in_flight[1:]
            self.stats.record_acceptance(kept)  # every row that ran (a chained one may follow its request's end)
            if req.finished:
                continue
            # this step's placeholder: the first of the request's in flight (the runs of earlier steps
            # moved it from where it was put)
            at = len(req.output_ids) - len(in_flight)
            if req.status == ReqStatus.RUNNING:  # the chained step in flight keeps its slots after them
                chained_slots = 1 + in_flight[1] if len(in_flight) > 1 else 0
                self.kv.truncate(req, len(req.prompt_ids) + at + kept + chained_slots)
            run = tokens[first_row : first_row + kept + 1]
            req.output_ids[at : at + 1] = run
            for j in range(len(run)):
                self._record_logprobs(req, result, first_row + j)
                if self._stop_after(req, at + j + 1):
                    run = run[: j + 1]
                    break
            events.append(ReqEvent(req, tuple(run), req.finished))
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
