"""What the fault bench counts: how each stream ended, judged against the greedy reference of its
prompt (``LLM.generate`` on the same model), and the load that sends them (greedy, a closed loop of
``one_stream`` calls on this process's event loop, until a deadline)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from .load_client import StreamResult, one_stream

# status codes that refuse a request clearly, before any token: overload, or a prompt that cannot fit
REFUSALS = frozenset({"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"})
# how a stream that was cut off ends at the client (its server gone, or it ended the stream early)
LOSSES = frozenset({"OK", "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED"})

Outcome = Literal["exact", "refused", "lost", "diverged", "other"]
Reference = list[int] | None  # the greedy tokens a prompt must get; None: it can never fit the KV pool


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def outcome(r: StreamResult, ref: Reference, refusals: frozenset[str] = REFUSALS) -> Outcome:
    """exact: all the reference's tokens, nothing else. diverged: a token that is not the reference's
    at its position (one sent twice, or a wrong one). lost: a prefix of the reference, cut short.
    refused: a status of ``refusals`` before any token (for a prompt that can never fit, only
    INVALID_ARGUMENT is right). other: any other end."""
    if ref is None:
        return "refused" if r.code == "INVALID_ARGUMENT" and not r.token_ids else "other"
    if common_prefix(r.token_ids, ref) < len(r.token_ids):
        return "diverged"
    if r.code == "OK" and len(r.token_ids) == len(ref):
        return "exact"
    if r.code in refusals and not r.token_ids:
        return "refused"
    return "lost" if r.code in LOSSES else "other"


@dataclass
class Tally:
    sent: int = 0
    completed_exact: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    diverged_streams: int = 0
    duplicated_tokens: int = 0  # tokens past the point where a stream left its reference
    other_errors: Counter[str] = field(default_factory=Counter)
    status_codes: Counter[str] = field(default_factory=Counter)

    def add(self, r: StreamResult, ref: Reference, refusals: frozenset[str] = REFUSALS) -> Outcome:
        kind = outcome(r, ref, refusals)
        self.sent += 1
        self.status_codes[r.code] += 1
        if kind == "exact":
            self.completed_exact += 1
        elif kind == "refused":
            self.refused[r.code] += 1
        elif kind == "lost":
            self.lost += 1
        elif kind == "diverged":
            self.diverged_streams += 1
            self.duplicated_tokens += len(r.token_ids) - common_prefix(r.token_ids, ref or [])
        else:
            self.other_errors[r.code] += 1
        return kind

    def summary(self) -> dict[str, Any]:
        return {"requests_sent": self.sent, "completed_exact": self.completed_exact,
                "refused": dict(sorted(self.refused.items())), "lost": self.lost,
                "diverged_streams": self.diverged_streams, "duplicated_tokens": self.duplicated_tokens,
                "other_errors": dict(sorted(self.other_errors.items())),
                "status_codes": dict(sorted(self.status_codes.items()))}


def tally(sent: Sequence[Sent], refusals: frozenset[str] = REFUSALS) -> Tally:
    t = Tally()
    for r, ref in sent:
        t.add(r, ref, refusals)
    return t


def memory(start: dict[str, float], end: dict[str, float], peak: dict[str, float] | None = None) -> dict[str, Any]:
    """Per role (router, engines): resident MiB at the start and end (and the peak between), growth."""
    out: dict[str, Any] = {}
    for role, mib in start.items():
        row = {"start_mib": mib, "end_mib": end[role], "growth_mib": round(end[role] - mib, 1)}
        if peak is not None:
            row["peak_mib"] = peak[role]
        out[role] = row
    return out


@dataclass(frozen=True)
class Workload:
    """A pool of prompts and their references, sent greedy (``ignore_eos``) ``new_tokens`` each,
    ``concurrency`` streams in flight (a closed loop) over ``channels`` channels."""

    prompts: list[list[int]]
    refs: list[Reference]
    new_tokens: int
    concurrency: int
    channels: int = 2
    timeout: float = 120.0  # of each stream
    retry_after: float = 0.5  # seconds a worker waits after a refusal or an unreachable server


Sent = tuple[StreamResult, Reference]  # a stream's end and the reference it is judged by

# the channels reconnect within a second of a server coming back (gRPC's default backoff reaches minutes)
CLIENT_CHANNEL = [("grpc.use_local_subchannel_pool", 1), ("grpc.initial_reconnect_backoff_ms", 200),
                  ("grpc.max_reconnect_backoff_ms", 1000)]


async def send_async(address: str, work: Workload, label: str, seconds: float | None = None,
                     count: int | None = None, stop: threading.Event | None = None) -> list[Sent]:
    """Streams for ``seconds`` (then the ones in flight finish), ``count`` of them, or until ``stop``
    is set, whichever ends first, on the running event loop (the servers are other processes);
    request N is ``LABEL-N``, with prompt N of the pool (modulo its size). The channels stay open
    throughout: a server that goes and comes back is reconnected to."""
    import grpc

    from ...proto.v1 import generate_pb2_grpc

    deadline = time.monotonic() + (seconds if seconds is not None else 10 * work.timeout)
    channels = [grpc.aio.insecure_channel(address, options=CLIENT_CHANNEL) for _ in range(work.channels)]
    stubs = [generate_pb2_grpc.GenerateStub(c) for c in channels]
    issued = itertools.count()
    out: list[Sent] = []

    async def worker() -> None:
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            n = next(issued)
            if count is not None and n >= count:
                return
            i = n % len(work.prompts)
            r = await one_stream(stubs[n % len(stubs)], (f"{label}-{n}", work.prompts[i]), work.new_tokens,
                                 work.timeout)
            out.append((r, work.refs[i]))
            if r.code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED") and not r.token_ids:
                await asyncio.sleep(work.retry_after)  # as a client should: retry a little later

    try:
        await asyncio.gather(*(worker() for _ in range(work.concurrency)))
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    return out


def send(address: str, work: Workload, label: str, seconds: float | None = None, count: int | None = None,
         stop: threading.Event | None = None) -> list[Sent]:
    """``send_async`` on an event loop of its own."""
    return asyncio.run(send_async(address, work, label, seconds, count, stop))


class Background:
    """``send`` on a thread of its own, from now until ``finish`` (which returns its streams)."""

    def __init__(self, address: str, work: Workload, label: str) -> None:
        self._stop = threading.Event()
        self._sent: list[Sent] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(address, work, label), name=f"load-{label}",
                                        daemon=True)
        self._thread.start()

    def _run(self, address: str, work: Workload, label: str) -> None:
        try:
            self._sent = send(address, work, label, stop=self._stop)
        except BaseException as exc:  # re-raised by finish()
            self._error = exc

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def finish(self) -> list[Sent]:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"the load failed: {self._error}") from self._error
        return self._sent
