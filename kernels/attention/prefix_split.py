"""Splitting the cached prefixes of a paged prefill step into segments, so that FA3 has work for every SM.

FlashInfer's FA3 paged prefill gives each (request, tile of 128 query rows, query head) one CTA and does
not split the keys. A step whose queries are few but whose keys are many (a MIXED step of a few hundred
prompt tokens over a 32K prefix; a small chunk of a long prompt) then has fewer CTAs than SMs, each over
the whole prefix: the 8B shape's 288-token chunk makes 96 such CTAs on 132 SMs. The plan here cuts each
long prefix, at page boundaries, into segments that the queries attend to without a mask (every prefix
key precedes every query of the step). The rest of the request's keys (the partial page the prefix ends
in, and the step's own tokens) stay causal in the step's main plan. The partial outputs are merged by
their log-sum-exp afterwards."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

QUERY_TILE = 128  # query rows of one FA3 CTA (head_dim 128)


@dataclass(frozen=True)
class SplitRule:
    """When and how finely to split. ``min_prefix``: tokens of full pages a request's prefix must have;
    ``min_segment``: tokens a segment keeps at least; ``max_segments``: segments of one prefix at most;
    ``balance``: how many times the longest CTA's work fits into the average SM's work the split aims at
    (more than 1: the greedy assignment of CTAs to SMs needs some slack)."""

    min_prefix: int = 2048
    min_segment: int = 1024
    max_segments: int = 16
    balance: float = 2.0


@dataclass(frozen=True)
class PrefixSplit:
    """The split of one step. The main plan's page table has the split requests' prefixes cut to their
    last partial page; the prefix plan has ``segments`` x ``len(rows)`` requests, segment-major (segment 0
    of every split request, then segment 1, ...), each the queries of its request over full pages."""

    rows: list[int]  # requests (batch rows) whose prefixes are split
    segments: int
    query_index: np.ndarray  # [n] int64: the split requests' query rows, in request order
    main: tuple[np.ndarray, np.ndarray, np.ndarray]  # (indptr [B+1], indices, last_page_len [B]) int32
    prefix_qo_indptr: np.ndarray  # [segments * len(rows) + 1] int32
    prefix: tuple[np.ndarray, np.ndarray, np.ndarray]  # (indptr, indices, last_page_len) int32


def _work(extend: list[int], kv: list[int]) -> tuple[float, float]:
    """(the largest CTA's work, all CTAs' work) of one query head, in query rows x keys."""
    tiles = [min(QUERY_TILE, e - t) * k for e, k in zip(extend, kv) for t in range(0, e, QUERY_TILE)]
    return float(max(tiles, default=0)), float(sum(tiles))


def plan_prefix_split(indptr: np.ndarray, indices: np.ndarray, last: np.ndarray, prefix_lens: list[int],
                      extend_lens: list[int], page_size: int, num_heads: int, num_sms: int,
                      rule: SplitRule = SplitRule()) -> PrefixSplit | None:
    """The split of a paged prefill step with page table (``indptr``, ``indices``, ``last``), or None where
    the step already has work for every SM (or no prefix long enough to cut)."""
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    biggest, total = _work(extend_lens, seq)
    if total == 0 or biggest * rule.balance * num_sms <= total * num_heads:
        return None
    full = [p // page_size for p in prefix_lens]  # whole pages of each prefix
    rows = [r for r, (f, e) in enumerate(zip(full, extend_lens)) if e > 1 and f * page_size >= rule.min_prefix]
    if not rows:
        return None
    want = math.ceil(biggest * rule.balance * num_sms / (total * num_heads))
    fit = min(full[r] * page_size // rule.min_segment for r in rows)
    segments = min(want, fit, rule.max_segments)
    if segments < 2:
        return None
    cut = set(rows)
    main_pages = [indices[indptr[r] + (full[r] if r in cut else 0): indptr[r + 1]] for r in range(len(seq))]
    main_indptr = np.zeros(len(seq) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in main_pages], out=main_indptr[1:])
    seg_pages, seg_q = [], []
    for s in range(segments):
        for r in rows:
            lo, hi = full[r] * s // segments, full[r] * (s + 1) // segments
            seg_pages.append(indices[indptr[r] + lo: indptr[r] + hi])
            seg_q.append(extend_lens[r])
    seg_indptr = np.zeros(len(seg_pages) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in seg_pages], out=seg_indptr[1:])
    qo_indptr = np.zeros(len(seg_q) + 1, dtype=np.int32)
    np.cumsum(seg_q, out=qo_indptr[1:])
    starts = np.concatenate([[0], np.cumsum(extend_lens)])
    query_index = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in rows]).astype(np.int64)
    return PrefixSplit(rows, segments, query_index,
                       (main_indptr, np.concatenate(main_pages).astype(np.int32), last.astype(np.int32)),
                       qo_indptr, (seg_indptr, np.concatenate(seg_pages).astype(np.int32),
                                   np.full(len(seg_pages), page_size, dtype=np.int32)))
