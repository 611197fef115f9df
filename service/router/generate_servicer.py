"""The ``modeserve.v1.Generate`` service: tokenize, pick an engine loop, stream tokens and text."""

from __future__ import annotations

import logging
import queue
import time
import uuid
from typing import Iterator, Sequence

import grpc
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from ...engine.tokenizer import Tokenizer
from ...proto.v1 import generate_pb2, generate_pb2_grpc
from .rank_loop import QueueFullError, RequestHandle
from ..rpc.convert import mode_stats_to_proto
from ..telemetry.metrics import RequestMetrics
from .rank_table import RankTable
from ..telemetry.tracing import Tracing, extract
from .request_validation import RequestLimits, check_prompt_shape, sampling_from_proto
from .text_stream import TextStream

logger = logging.getLogger(__name__)

GENERATE_SERVICE = "modeserve.v1.Generate"


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, tokenizer: Tokenizer | None, table: RankTable, limits: RequestLimits,
                 model_name: str, eos_token_ids: Sequence[int], metrics: RequestMetrics | None = None,
                 tracing: Tracing | None = None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.tracing = tracing or Tracing("router", env={})
        self.table = table
        self.limits = limits
        self.model_name = model_name
        self.eos_token_ids = list(eos_token_ids)

    def _prompt_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        check_prompt_shape(request, self.limits)
        if request.token_ids:
            return list(request.token_ids)
        if self.tokenizer is None:
            raise ValueError("text: this model has no tokenizer; send token_ids")
        if request.chat:
            return self.tokenizer.apply_chat_template(request.text)
        ids = self.tokenizer.encode(request.text)
        if not ids:
            raise ValueError("text: the prompt is empty after tokenization")
        return ids

    def Generate(self, request: generate_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[generate_pb2.GenerateResponse]:
        rid = request.request_id or uuid.uuid4().hex
        arrived = time.perf_counter()
        span = self._request_span(request, context) if self.tracing.enabled else None
        try:
            sampling = sampling_from_proto(request.sampling, self.limits)
            prompt_ids = self._prompt_ids(request)
            loop = self.table.dispatcher.choose(self.table.ready_loops(), prompt_ids)
            req = loop.make_request(rid, prompt_ids, sampling)
            if span is not None:
                span.set_attribute("gen_ai.usage.input_tokens", len(prompt_ids))
            handle = loop.submit(req, span)
        except (LookupError, QueueFullError, ValueError) as exc:
            code = (grpc.StatusCode.UNAVAILABLE if isinstance(exc, LookupError) else  # no rank ready
                    grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(exc, QueueFullError) else
                    grpc.StatusCode.INVALID_ARGUMENT)
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                span.end()
            context.abort(code, str(exc))
        context.add_callback(lambda: self.table.abort(rid))  # client cancel or deadline: free its KV
        try:
            yield from self._stream(rid, handle, sampling.stop, context, arrived)
        finally:  # a cancelled stream is closed at its yield: its span still ends, with its steps
            if handle.span is not None and handle.span.is_recording():
                handle.link_steps()
                handle.span.set_status(Status(StatusCode.ERROR, "client went away"))
                handle.span.end()

    def _request_span(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext) -> Span:
        """The request's span (gen_ai conventions), a child of the client's W3C context if it sent one."""
        parent = extract({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        span = self.tracing.start_span(f"text_completion {self.model_name}", parent, SpanKind.SERVER)
        sp = request.sampling
        span.set_attributes({"gen_ai.operation.name": "text_completion", "gen_ai.system": "modeserve",
                             "gen_ai.request.model": self.model_name, "gen_ai.request.max_tokens": sp.max_new_tokens,
                             "gen_ai.request.temperature": sp.temperature})
        return span

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

    def _stream(self, rid: str, handle: RequestHandle, stop: Sequence[str],
                context: grpc.ServicerContext, arrived: float) -> Iterator[generate_pb2.GenerateResponse]:
        text = TextStream(self.tokenizer, stop) if self.tokenizer is not None else None
        num_out = 0
        last: float | None = None
        while True:
            try:
                upd = handle.updates.get(timeout=0.5)
            except queue.Empty:
                if not context.is_active():
                    return  # the span ends in Generate
                continue
            tokens = list(upd.token_ids)
            num_out += len(tokens)
            if tokens:
                if last is None and handle.span is not None:
                    handle.span.set_attribute("gen_ai.server.time_to_first_token", time.perf_counter() - arrived)
                last = self._observe(len(tokens), last, arrived)
            delta = text.push(tokens) if text is not None else ""
            if upd.finish_reason is None:
                if tokens:
                    yield generate_pb2.GenerateResponse(request_id=rid, token_ids=tokens, text=delta,
                                                        logprobs=list(upd.logprobs))
                continue
            if text is not None:
                delta += text.finish()
            if self.metrics is not None:
                self.metrics.requests.labels(finish_reason=upd.finish_reason).inc()
            if handle.span is not None:
                handle.span.set_attributes({"gen_ai.usage.output_tokens": num_out,
                                            "gen_ai.response.finish_reasons": [upd.finish_reason]})
                handle.span.end()
            req = handle.req
            usage = generate_pb2.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=num_out,
                                       cached_tokens=req.num_cached_prompt_tokens)
            yield generate_pb2.GenerateResponse(request_id=rid, token_ids=tokens, text=delta,
                                                finish_reason=upd.finish_reason, usage=usage,
                                                logprobs=list(upd.logprobs))
            return

    def Tokenize(self, request: generate_pb2.TokenizeRequest,
                 context: grpc.ServicerContext) -> generate_pb2.TokenizeResponse:
        if self.tokenizer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
        if len(request.text) > self.limits.max_prompt_chars:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"text: over {self.limits.max_prompt_chars} characters")
        assert self.tokenizer is not None
        ids = self.tokenizer.apply_chat_template(request.text) if request.chat else self.tokenizer.encode(request.text)
        return generate_pb2.TokenizeResponse(token_ids=ids)

    def ModelInfo(self, request: generate_pb2.ModelInfoRequest,
                  context: grpc.ServicerContext) -> generate_pb2.ModelInfoResponse:
        return generate_pb2.ModelInfoResponse(model=self.model_name, context_length=self.limits.max_context,
                                              vocab_size=self.limits.vocab_size, num_ranks=len(self.table.ready_loops()),
                                              mode_stats=mode_stats_to_proto(
                                                  lp.scheduler.stats for lp in self.table.all_loops()),
                                              eos_token_ids=self.eos_token_ids)
