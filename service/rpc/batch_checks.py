"""The bounds a decoded step must keep on its engine, checked in O(batch) vectorised numpy: slot-table
rows, positions, KV slots, token ids, and the shape each forward mode's runner path indexes by. Each
failure is a ``ValueError`` naming the field and the first offending entry."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...engine.forward_mode import ForwardMode


class BatchLimits(NamedTuple):
    """What a batch may index on the receiving engine."""

    max_reqs: int  # rows of the request->slot table
    max_context: int  # positions per row
    num_kv_slots: int  # token slots of the KV pool
    vocab_size: int
    num_layers: int  # decoder layers (a SPLIT_PREFILL step's range lies within)


def check_range(a: np.ndarray, lo: int, hi: int, field: str) -> None:
    """Every value in [lo, hi); names the first offender."""
    if a.size and (int(a.min()) < lo or int(a.max()) >= hi):
        i = int(np.flatnonzero((a < lo) | (a >= hi))[0])
        raise ValueError(f"{field}[{i}] = {int(a[i])} is outside [{lo}, {hi})")


def check_requests(mode: ForwardMode, req_pool: np.ndarray, prefix: np.ndarray, ext: np.ndarray, mask: np.ndarray,
                    limits: BatchLimits) -> None:
    num_reqs = req_pool.shape[0]
    for name, arr in (("prefix_lens", prefix), ("extend_lens", ext), ("sample_mask", mask)):
        if arr.shape[0] != num_reqs:
            raise ValueError(f"{name} has {arr.shape[0]} entries but req_pool_indices has {num_reqs} "
                             f"(one per request)")
    check_range(req_pool, 0, limits.max_reqs, "req_pool_indices")
    if num_reqs > 1 and np.unique(req_pool).shape[0] != num_reqs:
        raise ValueError("req_pool_indices: a slot-table row appears twice in one batch")
    check_range(prefix, 0, limits.max_context + 1, "prefix_lens")
    check_range(ext, 0, limits.max_context + 1, "extend_lens")
    seq_lens = prefix + ext  # no overflow: both checked above
    if num_reqs and int(seq_lens.max()) > limits.max_context:
        i = int(np.argmax(seq_lens))
        raise ValueError(f"prefix_lens[{i}] + extend_lens[{i}] = {int(seq_lens[i])} exceeds max_context "
                         f"{limits.max_context}")
    if num_reqs and int(mask.max()) > 1:
        raise ValueError(f"sample_mask[{int(np.argmax(mask > 1))}] = {int(mask.max())}; each entry must be 0 or 1")
    empty_samplers = np.flatnonzero((mask != 0) & (ext == 0))
    if empty_samplers.size:
        raise ValueError(f"sample_mask[{int(empty_samplers[0])}] is set but extend_lens is 0 (nothing to sample from)")
    # the shape each mode's runner path indexes by (the scheduler builds no other)
    if mode == ForwardMode.IDLE and num_reqs:
        raise ValueError(f"forward_mode IDLE carries no requests, got {num_reqs}")
    if mode == ForwardMode.DECODE and not ((ext == 1) & (mask == 1)).all():
        raise ValueError("forward_mode DECODE takes one sampled token a request (extend_lens 1, sample_mask 1)")
    if mode == ForwardMode.SPLIT_PREFILL and (not num_reqs or int(ext.min()) < 1):
        raise ValueError("forward_mode SPLIT_PREFILL takes one or more requests, each with tokens to prefill")
    if mode == ForwardMode.TARGET_VERIFY and num_reqs and int(ext.min()) < 1:
        raise ValueError(f"forward_mode TARGET_VERIFY: extend_lens[{int(np.argmin(ext))}] = 0 (a request verifies "
                         f"its last token and its drafts)")


def check_tokens(prefix: np.ndarray, ext: np.ndarray, ids: np.ndarray, pos: np.ndarray, loc: np.ndarray,
                  limits: BatchLimits) -> None:
    num_tokens = int(ext.sum())
    for name, arr in (("input_ids", ids), ("positions", pos), ("out_cache_loc", loc)):
        if arr.shape[0] != num_tokens:
            raise ValueError(f"{name} has {arr.shape[0]} entries but sum(extend_lens) = {num_tokens}")
    check_range(ids, -1, limits.vocab_size, "input_ids")  # -1: overlap placeholder
    check_range(loc, 0, limits.num_kv_slots, "out_cache_loc")
    # Request r's tokens sit at positions prefix_lens[r], prefix_lens[r] + 1, ... in batch order.
    token_start = np.cumsum(ext) - ext  # [B]
    expected = np.arange(num_tokens, dtype=np.int64) + np.repeat(prefix - token_start, ext)  # [T]
    bad = np.flatnonzero(pos != expected)
    if bad.size:
        t = int(bad[0])
        r = int(np.searchsorted(token_start + ext, t, side="right"))
        raise ValueError(f"positions[{t}] = {int(pos[t])} but request {r} (prefix_lens {int(prefix[r])}, "
                         f"extend_lens {int(ext[r])}) puts position {int(expected[t])} there")


def check_slot(req_pool_idx: int, field: str, limits: BatchLimits) -> None:
    if not 0 <= req_pool_idx < limits.max_reqs:
        raise ValueError(f"{field}.req_pool_idx = {req_pool_idx} is outside [0, {limits.max_reqs})")
