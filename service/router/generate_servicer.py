"""The ``modeserve.v1.Generate`` service on the router's event loop: validate, pick a rank, then each
stream is a task awaiting its request's token updates (no thread per stream)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator, Sequence

import grpc
from opentelemetry.trace import SpanKind

from ...engine.tokenizer import Tokenizer
from ...proto.v1 import generate_pb2, generate_pb2_grpc
from ..rpc.convert import mode_stats_to_proto
from ..telemetry.metrics import RequestMetrics
from ..telemetry.step_tracing import RequestTrace
from ..telemetry.tracing import Tracing, extract
from .rank_loop import QueueFullError
from .rank_table import RankTable
from .request_handle import RequestHandle, TokenUpdate
from .request_validation import RequestParser
from .text_stream import TextStream

GENERATE_SERVICE = "modeserve.v1.Generate"


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, parser: RequestParser, table: RankTable, model_name: str, eos_token_ids: Sequence[int],
                 metrics: RequestMetrics | None = None, tracing: Tracing | None = None) -> None:
        self.parser = parser
        self.tokenizer: Tokenizer | None = parser.tokenizer
        self.metrics = metrics
        self.tracing = tracing or Tracing("router", env={})
        self.table = table
        self.model_name = model_name
        self.eos_token_ids = list(eos_token_ids)

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        rid = request.request_id or uuid.uuid4().hex
        arrived = time.perf_counter()
        trace = self._request_trace(request, context) if self.tracing.enabled else None
        try:
            req = self.parser.parse(rid, request)
            loop = self.table.dispatcher.choose(self.table.ready_loops(), req.prompt_ids)
            if trace is not None:
                trace.record.set_attributes({"gen_ai.usage.input_tokens": len(req.prompt_ids)})
            handle = RequestHandle(req, asyncio.Queue(), trace)
            loop.submit(handle)
        except (LookupError, QueueFullError, ValueError) as exc:
            code = (grpc.StatusCode.UNAVAILABLE if isinstance(exc, LookupError) else  # no rank ready
                    grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(exc, QueueFullError) else
                    grpc.StatusCode.INVALID_ARGUMENT)
            if trace is not None:
                trace.end(error=str(exc))
            await context.abort(code, str(exc))
            return
        finished = False
        try:
            async for response in self._stream(rid, handle, request.sampling.stop, arrived):
                finished = bool(response.finish_reason)
                yield response
        finally:  # client cancel or deadline (the task is cancelled at its await): free its KV
            if not finished:
                self.table.abort(rid)
                if trace is not None:
                    trace.end(error="client went away")

    def _request_trace(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> RequestTrace:
        """The request's span (gen_ai conventions), a child of the client's W3C context if it sent one."""
        parent = extract({k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)})
        sp = request.sampling
        span = self.tracing.start(f"text_completion {self.model_name}", parent, SpanKind.SERVER, {
            "gen_ai.operation.name": "text_completion", "gen_ai.system": "modeserve",
            "gen_ai.request.model": self.model_name, "gen_ai.request.max_tokens": sp.max_new_tokens,
            "gen_ai.request.temperature": sp.temperature})
        return RequestTrace(self.tracing, span)

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

    async def _stream(self, rid: str, handle: RequestHandle, stop: Sequence[str],
                      arrived: float) -> AsyncIterator[generate_pb2.GenerateResponse]:
        assert isinstance(handle.updates, asyncio.Queue)
        updates: asyncio.Queue[TokenUpdate] = handle.updates
        text = TextStream(self.tokenizer, stop) if self.tokenizer is not None else None
        trace = handle.trace
        num_out = 0
        last: float | None = None
        while True:
            upd = await updates.get()
            tokens = list(upd.token_ids)
            logprobs = list(upd.logprobs)
            while upd.finish_reason is None and not updates.empty():  # behind: one message for all that came
                upd = updates.get_nowait()
                tokens += upd.token_ids
                logprobs += upd.logprobs
            num_out += len(tokens)
            if tokens:
                if last is None and trace is not None:
                    trace.record.set_attributes({"gen_ai.server.time_to_first_token": time.perf_counter() - arrived})
                last = self._observe(len(tokens), last, arrived)
            delta = text.push(tokens) if text is not None else ""
            if upd.finish_reason is None:
                if tokens:
                    yield generate_pb2.GenerateResponse(request_id=rid, token_ids=tokens, text=delta,
                                                        logprobs=logprobs)
                continue
            if text is not None:
                delta += text.finish()
            if self.metrics is not None:
                self.metrics.requests.labels(finish_reason=upd.finish_reason).inc()
            if trace is not None:
                trace.record.set_attributes({"gen_ai.usage.output_tokens": num_out,
                                             "gen_ai.response.finish_reasons": [upd.finish_reason]})
                trace.end()
            req = handle.req
            usage = generate_pb2.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=num_out,
                                       cached_tokens=req.num_cached_prompt_tokens)
            yield generate_pb2.GenerateResponse(request_id=rid, token_ids=tokens, text=delta,
                                                finish_reason=upd.finish_reason, usage=usage,
                                                logprobs=logprobs)
            return

    async def Tokenize(self, request: generate_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generate_pb2.TokenizeResponse:
        if self.tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
        try:
            self.parser.check_text(request.text)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        assert self.tokenizer is not None
        ids = self.tokenizer.apply_chat_template(request.text) if request.chat else self.tokenizer.encode(request.text)
        return generate_pb2.TokenizeResponse(token_ids=ids)

    async def ModelInfo(self, request: generate_pb2.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> generate_pb2.ModelInfoResponse:
        limits = self.parser.limits
        return generate_pb2.ModelInfoResponse(
            model=self.model_name, context_length=limits.max_context, vocab_size=limits.vocab_size,
            num_ranks=len(self.table.ready_loops()),
            mode_stats=mode_stats_to_proto(lp.scheduler.stats for lp in self.table.all_loops()),
            eos_token_ids=self.eos_token_ids)
