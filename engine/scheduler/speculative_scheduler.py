"""The scheduler with speculative decoding: the running requests' steps are TARGET_VERIFY steps of their
drafts (``speculative`` makes the drafts and the batch), and each result's run of kept tokens is taken
back token by token."""

from __future__ import annotations

from typing import Any, Callable

from ..config import SchedulerConfig
from ..forward_batch import ForwardBatch, ForwardResult, LayerRange
from ..forward_mode import ForwardMode
from ..request import PLACEHOLDER, Req, ReqStatus
from .scheduled_step import ReqEvent, ScheduledStep
from .scheduler import Scheduler
from .speculative import Drafter, make_drafter, record_draft_steps, verify_arrays


class SpeculativeScheduler(Scheduler):
    def __init__(self, cfg: SchedulerConfig, num_pages: int, page_size: int, max_context: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], decode: Callable[[list[int]], str] | None = None,
                 num_layers: int = 0) -> None:
        super().__init__(cfg, num_pages, page_size, max_context, vocab_size, eos_token_ids, decode, num_layers)
        self.drafter: Drafter | None = make_drafter(cfg, max_context)
        # per request, the drafts of each of its TARGET_VERIFY steps in flight (two: the second chained)
        self._verifying: dict[Req, list[int]] = {}

    def _decoders(self) -> tuple[list[Req], list[Req]]:
        decodes, _ = super()._decoders()
        if self.drafter is None:
            return decodes, decodes
        # a request whose step is in flight verifies again only chained
        verifies = [r for r in decodes if PLACEHOLDER not in r.output_ids[-1:] or self._may_chain(r)]
        return [r for r in decodes if PLACEHOLDER not in r.output_ids[-1:]], verifies

    def _may_chain(self, req: Req) -> bool:
        """Whether ``req``'s next verify step may be built now, while its last one (its only step in flight)
        runs: n-gram drafts, and context for the case that step keeps all its drafts."""
        assert self.drafter is not None
        in_flight = self._verifying.get(req, [])
        return (self.drafter.chains and len(in_flight) == 1 and req.output_ids[-1:] == [PLACEHOLDER]
                and req.fill_len + in_flight[0] + self.drafter.k <= self.max_context)

    def _decode_step(self, decodes: list[Req], verifies: list[Req]) -> ScheduledStep | None:
        if verifies and self.drafter is not None:
            return self._build_verify(verifies, self.drafter)
        return super()._decode_step(decodes, verifies)

    def _build_verify(self, decodes: list[Req], drafter: Drafter) -> ScheduledStep | None:
        """A TARGET_VERIFY step: each decoding request's last token and its drafts (a plain DECODE step,
        which replays CUDA graphs, when no request has a draft). In it one placeholder a request stands for
        the run of tokens it emits; a request whose last verify step is still in flight is chained
        (``verify_arrays``)."""
        chain = {r for r in decodes if PLACEHOLDER in r.output_ids[-1:]}  # the engine drafts for these
        proposals = {r: [PLACEHOLDER] * drafter.k if r in chain else drafter.propose(r) for r in decodes}
        if not any(proposals.values()):
            return self._build([], self._reserve_decode(decodes))
        proposals = {r: d if r in chain else drafter.fill(r, d) for r, d in proposals.items()}
        reqs = self._reserve_decode(decodes, [1 + len(proposals[r]) for r in decodes])
        if not reqs:
            return None
        drafts = [proposals[r] for r in reqs]
        arrays = verify_arrays(reqs, drafts, [self._verifying[r][0] if r in chain else 0 for r in reqs])
        for r, d in zip(reqs, drafts):
            self._verifying.setdefault(r, []).append(len(d))
        self.stats.spec_verify_steps += 1
        self.stats.spec_draft_tokens += sum(map(len, drafts))
        self.stats.spec_chained_rows += sum(r in chain for r in reqs)
        return self._emit(ForwardMode.TARGET_VERIFY, tuple(reqs), arrays, None)

    def _make_batch(self, mode: ForwardMode, reqs: tuple[Req, ...], arrays: dict[str, Any],
                    split_layers: LayerRange | None) -> ForwardBatch:
        batch = super()._make_batch(mode, reqs, arrays, split_layers)
        if self.cfg.speculative_algorithm == "draft":
            record_draft_steps(self.stats, batch)
        return batch

    def process_result(self, step: ScheduledStep, result: ForwardResult) -> list[ReqEvent]:
        if step.batch.forward_mode == ForwardMode.TARGET_VERIFY:
            return self._process_verify(step, result)
        return super().process_result(step, result)

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
