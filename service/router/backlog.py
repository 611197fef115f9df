"""What the router holds for clients that do not read their streams: a bound on unsent tokens.

A stream's token updates wait in its queue while its client does not read (gRPC flow control blocks
the write, the scheduler keeps generating). Each waiting token costs the router memory (with 20 top
logprobs, kilobytes), and a request leaves the rank loop once its generation ends, so the queue
limit does not count it. ``Backlog`` counts the tokens queued and not yet taken across all streams;
past ``max_unsent_tokens`` it cancels the stream holding the most (its request is aborted and its
KV freed, as for a client that went away). Readers that keep up are never touched.
"""

from __future__ import annotations

import asyncio
import logging

from .request_handle import TokenUpdate

logger = logging.getLogger(__name__)


class StreamUpdates(asyncio.Queue[TokenUpdate]):
    """A stream's queue of updates, counted in its router's ``Backlog`` (event-loop thread only)."""

    def __init__(self, backlog: Backlog, task: asyncio.Task[object] | None) -> None:
        super().__init__()
        self.backlog = backlog
        self.task = task  # what to cancel: the task serving the stream
        self.unsent = 0

    def put_nowait(self, item: TokenUpdate) -> None:
        super().put_nowait(item)
        self.backlog.add(self, len(item.token_ids))

    def taken(self, item: TokenUpdate) -> TokenUpdate:
        """``item`` left the queue for the client: no longer held for it."""
        self.backlog.add(self, -len(item.token_ids))
        return item


class Backlog:
    def __init__(self, max_unsent_tokens: int) -> None:
        if max_unsent_tokens < 1:
            raise ValueError(f"--max-unsent-tokens must be >= 1, got {max_unsent_tokens}")
        self.max_unsent_tokens = max_unsent_tokens
        self.total = 0
        self.cancelled = 0  # streams cancelled for not reading
        self._streams: set[StreamUpdates] = set()

    def open(self, task: asyncio.Task[object] | None) -> StreamUpdates:
        updates = StreamUpdates(self, task)
        self._streams.add(updates)
        return updates

    def close(self, updates: StreamUpdates) -> None:
        """The stream ended: whatever it still held is let go."""
        if updates in self._streams:
            self._streams.discard(updates)
            self.total -= updates.unsent
            updates.unsent = 0

    def add(self, updates: StreamUpdates, tokens: int) -> None:
        if updates not in self._streams:
            return
        updates.unsent += tokens
        self.total += tokens
        while self.total > self.max_unsent_tokens:
            worst = max(self._streams, key=lambda u: u.unsent)
            logger.warning("a client holds %d unsent tokens (router total %d > --max-unsent-tokens %d): "
                           "its stream is cancelled", worst.unsent, self.total, self.max_unsent_tokens)
            self.close(worst)
            self.cancelled += 1
            if worst.task is not None:
                worst.task.cancel()
