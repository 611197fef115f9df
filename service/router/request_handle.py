"""A request in flight at the router: what the rank loops deliver to its stream."""

from __future__ import annotations

import functools
import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from ...engine.request import FinishReason, Req

if TYPE_CHECKING:
    from ..telemetry.step_tracing import RequestTrace


@dataclass(frozen=True)
class TokenUpdate:
    """New tokens of one request; ``finish_reason`` set on the last update."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # per token: (id, logprob) alternatives


class UpdateQueue(Protocol):
    def put_nowait(self, item: TokenUpdate) -> None: ...


@dataclass
class RequestHandle:
    """``updates`` is an ``asyncio.Queue`` for a Generate stream (the rank loop then delivers through
    the event loop), or a thread-safe queue for an in-process caller."""

    req: Req
    updates: UpdateQueue = field(default_factory=lambda: queue.SimpleQueue[TokenUpdate]())
    trace: RequestTrace | None = None


def continuation(old: Req) -> Req:
    """A fresh request that carries on ``old`` on another scheduler: prompt, sampling and seed as
    before, the tokens already delivered as outputs to recompute (placeholders of lost steps dropped)."""
    known = old.num_known - len(old.prompt_ids)
    return Req(rid=old.rid, prompt_ids=old.prompt_ids, sampling=old.sampling, seed=old.seed,
               output_ids=old.output_ids[:known], num_retractions=old.num_retractions + 1,
               num_cached_prompt_tokens=old.num_cached_prompt_tokens,
               output_logprobs=old.output_logprobs[:known], output_top_logprobs=old.output_top_logprobs[:known])


Post = Callable[[Callable[[], None]], object]  # run a callback on the consumers' thread (call_soon_threadsafe)


def _put_all(items: Sequence[tuple[RequestHandle, TokenUpdate]]) -> None:
    for handle, update in items:
        handle.updates.put_nowait(update)


def send_updates(post: Post | None, items: Sequence[tuple[RequestHandle, TokenUpdate]]) -> None:
    """Deliver ``items`` from any thread: directly into thread-safe queues, or with ``post`` as one
    callback on the event loop that owns the queues (nothing, once that loop is closed)."""
    if not items:
        return
    if post is None:
        _put_all(items)
        return
    try:
        post(functools.partial(_put_all, items))
    except RuntimeError:  # the event loop is closed: the server is gone, nobody is listening
        pass
