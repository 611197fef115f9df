"""What the scheduler hands the step loop for one step, what a step produced for a request, and the
array fields of the prefill and decode batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..forward_batch import ForwardBatch
from ..request import Req


@dataclass(frozen=True)
class Item:
    """One request's tokens computed by a step."""

    req: Req
    start: int  # first position computed this step
    length: int  # tokens computed this step


class Sample(NamedTuple):  # one per request per step: a tuple is made faster than a frozen dataclass
    req: Req
    output_index: int  # where the sampled token goes in req.output_ids (a placeholder until then)
    first: bool  # the request's first sample since (re)admission: its prompt is now computed


@dataclass(frozen=True)
class ScheduledStep:
    batch: ForwardBatch
    reqs: tuple[Req, ...]  # batch order
    samples: tuple[Sample, ...] = ()  # rows with sample_mask set, in batch order


@dataclass(frozen=True)
class ReqEvent:
    """What one step produced for one request."""

    req: Req
    new_token_ids: tuple[int, ...]
    finished: bool


def extend_arrays(items: list[Item], input_ids: list[int] | None = None) -> dict[str, Any]:
    """The array fields of a step computing ``items``; their tokens' ids, or ``input_ids`` where given (a
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


def decode_arrays(decodes: list[Req]) -> dict[str, Any]:
    """The array fields of a DECODE step (a few milliseconds a step, every running request in it: plain
    lists, no per-row arrays)."""
    pos = [r.num_computed - 1 for r in decodes]
    return {"prefix_lens": np.array(pos, dtype=np.int64), "extend_lens": np.ones(len(pos), dtype=np.int64),
            "sample_mask": np.ones(len(pos), dtype=bool), "positions": np.array(pos, dtype=np.int64),
            "input_ids": np.array([r.tokens(p, p + 1)[0] for r, p in zip(decodes, pos)], dtype=np.int64),
            "out_cache_loc": np.array([r.kv_locs[-1] for r in decodes], dtype=np.int64)}
