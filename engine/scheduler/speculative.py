"""The scheduler's side of speculative decoding with n-gram drafts: the drafts a request may take,
and what a TARGET_VERIFY step carries for each request (``Scheduler._process_verify`` takes its result).

A verifying request computes its last token and up to k drafts after it (prompt lookup in its own
tokens, ``ngram.propose_ngram``); the engine returns the target's token after each of them and how
many drafts it kept. The request then takes the kept drafts and the target's token after them (its
correction, or the bonus token when all were kept): at least one token a step, as a decode gives.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..config import SchedulerConfig
from ..forward_batch import ForwardBatch
from ..forward_mode import ForwardMode
from ..request import PLACEHOLDER, Req
from .ngram import propose_ngram
from .stats import ForwardModeStats


class Drafter:
    """The drafts of ``speculative_algorithm="draft"``: k placeholders a request, which the engine's
    draft model fills in the verify step (no more than the request has room for)."""

    # whether a request's next verify step may be built while its last one runs (its drafts made on the
    # device: ``runner.chained_verify``); the draft model catches up on the host's positions, so not it
    chains = False

    def __init__(self, cfg: SchedulerConfig, max_context: int) -> None:
        self.k = cfg.speculative_num_steps
        self.max_context = max_context

    def room(self, req: Req) -> int:
        """Drafts ``req`` may take: no more than it may still emit after the target's first token, nor
        than its context has room for."""
        return min(self.k, req.sampling.max_new_tokens - len(req.output_ids) - 1, self.max_context - req.fill_len)

    def propose(self, req: Req) -> list[int]:
        return [0] * max(self.room(req), 0)

    def fill(self, req: Req, drafts: list[int]) -> list[int]:
        """``drafts`` made up to the request's room by repeating its last draft (or its last token): a
        verify step of k drafts a request has one shape, which replays a CUDA graph, and costs about
        what one with fewer does. Any proposal is exact (a draft is kept only where it equals the
        target's own draw), so the made-up ones are kept when they happen to be right."""
        more = self.room(req) - len(drafts)
        return drafts + [drafts[-1] if drafts else req.tokens(req.fill_len - 1, req.fill_len)[0]] * more if more > 0 else drafts


class NgramDrafter(Drafter):
    chains = True

    def __init__(self, cfg: SchedulerConfig, max_context: int) -> None:
        super().__init__(cfg, max_context)
        self.min_n, self.max_n = cfg.speculative_ngram_min, cfg.speculative_ngram_max

    def propose(self, req: Req) -> list[int]:
        """Up to ``room`` drafts for ``req`` (a decoding request, its ids all known) by prompt lookup."""
        room = self.room(req)
        if room < 1:
            return []
        tokens = np.asarray(req.fill_ids, dtype=np.int64)
        return propose_ngram(tokens, room, self.min_n, self.max_n).tolist()


def make_drafter(cfg: SchedulerConfig, max_context: int) -> Drafter | None:
    drafters = {"ngram": NgramDrafter, "draft": Drafter}
    return drafters[cfg.speculative_algorithm](cfg, max_context) if cfg.speculative_algorithm else None


def record_draft_steps(stats: ForwardModeStats, batch: ForwardBatch) -> None:
    """The draft model's sub-steps in a step of ``batch`` (``speculative_algorithm="draft"``): its
    DRAFT_EXTEND over an EXTEND/MIXED step's tokens; in a TARGET_VERIFY step, its catch-up
    (DRAFT_EXTEND of each request's last two tokens), then a DECODE step per draft after the first."""
    if batch.forward_mode.traits.is_extend and (batch.split_layers is None or batch.split_layers.begin == 0):
        stats.record(ForwardMode.DRAFT_EXTEND, batch.batch_size, batch.num_tokens)  # a split's: with its first slice
    elif batch.forward_mode == ForwardMode.TARGET_VERIFY:
        stats.record(ForwardMode.DRAFT_EXTEND, batch.batch_size, 2 * batch.batch_size)
        for j in range(2, int(batch.extend_lens.max())):
            rows = int((batch.extend_lens > j).sum())
            stats.record(ForwardMode.DECODE, rows, rows)


def verify_arrays(reqs: Sequence[Req], drafts: Sequence[list[int]], ahead: Sequence[int]) -> dict[str, Any]:
    """The array fields of a TARGET_VERIFY batch: request r runs its last token and its drafts at
    positions ``fill_len - 1 ...`` into the KV slots reserved for them; every request samples.

    A chained request (``ahead[r]`` > 0) has its last verify step, of ``ahead[r]`` drafts, still in
    flight (its one placeholder stands for that step's run): its row is sent as if that step kept all
    its drafts (``ahead[r]`` positions further on, into the slots reserved there), with ids -1 only;
    the engine moves it to where that step left it (``runner.chained_verify``)."""
    prefix = np.fromiter((r.fill_len - 1 + a for r, a in zip(reqs, ahead)), dtype=np.int64, count=len(reqs))
    ext = np.fromiter((1 + len(d) for d in drafts), dtype=np.int64, count=len(reqs))
    ids: list[int] = []
    locs: list[int] = []
    for r, d, a, p, e in zip(reqs, drafts, ahead, prefix.tolist(), ext.tolist()):
        ids.append(PLACEHOLDER if a else r.tokens(p, p + 1)[0])
        ids.extend(d)
        locs.extend(r.kv_locs[p : p + e])
    return {"prefix_lens": prefix, "extend_lens": ext, "sample_mask": np.ones(len(reqs), dtype=bool),
            "positions": np.concatenate([np.arange(p, p + e, dtype=np.int64) for p, e in zip(prefix, ext)]),
            "input_ids": np.asarray(ids, dtype=np.int64), "out_cache_loc": np.asarray(locs, dtype=np.int64)}

