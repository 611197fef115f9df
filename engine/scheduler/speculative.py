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
from ..request import Req
from .ngram import propose_ngram


class NgramDrafter:
    def __init__(self, cfg: SchedulerConfig, max_context: int) -> None:
        self.k = cfg.speculative_num_steps
        self.min_n, self.max_n = cfg.speculative_ngram_min, cfg.speculative_ngram_max
        self.max_context = max_context

    def propose(self, req: Req) -> list[int]:
        """Up to k drafts for ``req`` (a decoding request, its ids all known): no more than it may
        still emit after the target's first token, nor than its context has room for."""
        room = min(self.k, req.sampling.max_new_tokens - len(req.output_ids) - 1, self.max_context - req.fill_len)
        if room < 1:
            return []
        tokens = np.asarray(req.fill_ids, dtype=np.int64)
        return propose_ngram(tokens, room, self.min_n, self.max_n).tolist()


def verify_arrays(reqs: Sequence[Req], drafts: Sequence[list[int]]) -> dict[str, Any]:
    """The array fields of a TARGET_VERIFY batch: request r runs its last token and its drafts at
    positions ``fill_len - 1 ...`` into the KV slots reserved for them; every request samples."""
    prefix = np.fromiter((r.fill_len - 1 for r in reqs), dtype=np.int64, count=len(reqs))
    ext = np.fromiter((1 + len(d) for d in drafts), dtype=np.int64, count=len(reqs))
    ids: list[int] = []
    locs: list[int] = []
    for r, d, p, e in zip(reqs, drafts, prefix.tolist(), ext.tolist()):
        ids.append(r.tokens(p, p + 1)[0])
        ids.extend(d)
        locs.extend(r.kv_locs[p : p + e])
    return {"prefix_lens": prefix, "extend_lens": ext, "sample_mask": np.ones(len(reqs), dtype=bool),
            "positions": np.concatenate([np.arange(p, p + e, dtype=np.int64) for p, e in zip(prefix, ext)]),
            "input_ids": np.asarray(ids, dtype=np.int64), "out_cache_loc": np.asarray(locs, dtype=np.int64)}

