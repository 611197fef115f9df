"""The one request path of every public API (gRPC ``Generate``, the OpenAI HTTP API): a validated
``Req`` goes to a rank, and its token updates come back as ``Delta``s (text stop-string- and
UTF-8-safe, TTFT/ITL observed, the request's span kept); a stream given up early aborts its request."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncGenerator, Callable, Iterable, NamedTuple

from opentelemetry.trace import SpanKind

from ...engine.request import Req
from ..telemetry.metrics import RequestMetrics
from ..telemetry.step_tracing import RequestTrace
from ..telemetry.tracing import Tracing, extract
from ..rpc.grpc_server import ServerOptions
from .backlog import Backlog, StreamUpdates
from .rank_table import RankTable
from .request_handle import RequestHandle
from .request_validation import RequestParser
from .text_stream import TextStream


class Draining(LookupError):
    """The router is shutting down: no new requests."""


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Delta:
    """What a request produced since the previous delta; the last one has ``finish_reason`` and ``usage``."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[tuple[tuple[int, float], ...]]
    finish_reason: str | None = None
    usage: Usage | None = None


class Generation:
    def __init__(self, parser: RequestParser, table: RankTable, model_name: str, metrics: RequestMetrics | None,
                 tracing: Tracing, backlog: Backlog | None = None) -> None:
        self.parser = parser
        self.backlog = backlog or Backlog(ServerOptions.max_unsent_tokens)
        self.tokenizer = parser.tokenizer
        self.table = table
        self.model_name = model_name
        self.metrics = metrics
        self.tracing = tracing
        self.draining = False

    def trace(self, operation: str, metadata: Iterable[tuple[str, object]], max_tokens: int,
              temperature: float) -> RequestTrace | None:
        """The request's span (gen_ai conventions), a child of the W3C context in the call's metadata
        (gRPC metadata or HTTP headers) if the client sent one; read only when tracing is on."""
        if not self.tracing.enabled:
            return None
        parent = extract({k: v for k, v in metadata if isinstance(v, str)})
        span = self.tracing.start(f"{operation} {self.model_name}", parent, SpanKind.SERVER, {
            "gen_ai.operation.name": operation, "gen_ai.system": "modeserve",
            "gen_ai.request.model": self.model_name, "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": temperature})
        return RequestTrace(self.tracing, span)

    def submit(self, build: Callable[[], Req], trace: RequestTrace | None) -> RequestHandle:
        """Build the request (``ValueError`` naming a field) and dispatch it to a ready rank:
        ``Draining`` or ``LookupError`` (no rank ready), or ``QueueFullError`` (its queue is full);
        the trace is ended with any error."""
        try:
            req = build()
            if self.draining:
                raise Draining("the server is shutting down")
            loop = self.table.dispatcher.choose(self.table.ready_loops(), req.prompt_ids)
            handle = RequestHandle(req, self.backlog.open(None), trace)
            loop.submit(handle)
        except Exception as exc:
            if trace is not None:
                trace.end(error=str(exc))
            raise
        if trace is not None:
            trace.record.set_attributes({"gen_ai.usage.input_tokens": len(req.prompt_ids)})
        return handle

    async def stream(self, handle: RequestHandle, arrived: float) -> AsyncGenerator[Delta, None]:
        """The request's deltas (updates that queued up while the consumer was busy come as one).
        Closed or cancelled before the last one, it aborts the request (its KV freed)."""
        updates = handle.updates
        assert isinstance(updates, StreamUpdates)
        updates.task = asyncio.current_task()  # a stream that holds too much unread is cancelled here
        req, trace = handle.req, handle.trace
        text = TextStream(self.tokenizer, req.sampling.stop) if self.tokenizer is not None else None
        num_out, last, finished = 0, None, False
        try:
            while not finished:
                upd = updates.taken(await updates.get())
                tokens, logprobs, top = list(upd.token_ids), list(upd.logprobs), list(upd.top_logprobs)
                while upd.finish_reason is None and not updates.empty():
                    upd = updates.taken(updates.get_nowait())
                    tokens += upd.token_ids
                    logprobs += upd.logprobs
                    top += upd.top_logprobs
                num_out += len(tokens)
                if tokens:
                    if last is None and trace is not None:
                        trace.record.set_attributes({"gen_ai.server.time_to_first_token": time.perf_counter() - arrived})
                    last = self._observe(len(tokens), last, arrived)
                delta = text.push(tokens) if text is not None else ""
                finished = upd.finish_reason is not None
                if not finished:
                    if tokens:
                        yield Delta(tokens, delta, logprobs, top)
                    continue
                if text is not None:
                    delta += text.finish()
                self._finished(trace, upd.finish_reason, num_out)
                usage = Usage(len(req.prompt_ids), num_out, req.num_cached_prompt_tokens)
                yield Delta(tokens, delta, logprobs, top, upd.finish_reason, usage)
        finally:  # client cancel, disconnect or deadline: free its KV
            self.backlog.close(updates)
            if not finished:
                self.table.abort(req.rid)
                if trace is not None:
                    trace.end(error="client went away")

    def _observe(self, tokens: int, last: float | None, arrived: float) -> float:
        """A message of ``tokens`` tokens reached the stream now: the first one's time to first
        token, or the gap since the previous message shared by its tokens. Returns now."""
        now = time.perf_counter()
        if self.metrics is not None:
            if last is None:
                self.metrics.ttft.observe(now - arrived)
            else:
                for _ in range(tokens):
                    self.metrics.itl.observe((now - last) / tokens)
        return now

    def _finished(self, trace: RequestTrace | None, reason: str | None, num_out: int) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(finish_reason=reason).inc()
        if trace is not None:
            trace.record.set_attributes({"gen_ai.usage.output_tokens": num_out,
                                         "gen_ai.response.finish_reasons": [reason]})
            trace.end()
