"""The ``modeserve.v1.Generate`` service on the router's event loop: each stream is a task awaiting
its request's deltas from the shared request path (no thread per stream)."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import AsyncIterator, Sequence

import grpc

from ...proto.v1 import generate_pb2, generate_pb2_grpc
from ..rpc.convert import mode_stats_to_proto
from .generation import Delta, Generation
from .rank_loop import QueueFullError

GENERATE_SERVICE = "modeserve.v1.Generate"


def delta_to_proto(rid: str, d: Delta) -> generate_pb2.GenerateResponse:
    top = [generate_pb2.TopLogprobs(token_ids=[t for t, _ in alts], logprobs=[lp for _, lp in alts])
           for alts in d.top_logprobs]
    out = generate_pb2.GenerateResponse(request_id=rid, token_ids=d.token_ids, text=d.text, logprobs=d.logprobs,
                                        top_logprobs=top, finish_reason=d.finish_reason or "")
    if d.usage is not None:
        out.usage.CopyFrom(generate_pb2.Usage(prompt_tokens=d.usage.prompt_tokens,
                                              completion_tokens=d.usage.completion_tokens,
                                              cached_tokens=d.usage.cached_tokens))
    return out


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, generation: Generation, eos_token_ids: Sequence[int]) -> None:
        self.generation = generation
        self.parser = generation.parser
        self.eos_token_ids = list(eos_token_ids)

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        rid = request.request_id or uuid.uuid4().hex
        arrived = time.perf_counter()
        gen = self.generation
        trace = gen.trace("text_completion", context.invocation_metadata() or (), request.sampling.max_new_tokens,
                          request.sampling.temperature)
        try:
            handle = gen.submit(lambda: self.parser.parse(rid, request), trace)
        except (LookupError, QueueFullError, ValueError) as exc:
            code = (grpc.StatusCode.UNAVAILABLE if isinstance(exc, LookupError) else  # no rank ready, draining
                    grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(exc, QueueFullError) else
                    grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, str(exc))
            return
        async with contextlib.aclosing(gen.stream(handle, arrived)) as deltas:
            async for d in deltas:
                yield delta_to_proto(rid, d)

    async def Tokenize(self, request: generate_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generate_pb2.TokenizeResponse:
        tokenizer = self.parser.tokenizer
        if tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
        try:
            self.parser.check_text(request.text)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        assert tokenizer is not None
        ids = tokenizer.apply_chat_template(request.text) if request.chat else tokenizer.encode(request.text)
        return generate_pb2.TokenizeResponse(token_ids=ids)

    async def ModelInfo(self, request: generate_pb2.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> generate_pb2.ModelInfoResponse:
        limits = self.parser.limits
        table = self.generation.table
        return generate_pb2.ModelInfoResponse(
            model=self.generation.model_name, context_length=limits.max_context, vocab_size=limits.vocab_size,
            num_ranks=len(table.ready_loops()),
            mode_stats=mode_stats_to_proto(lp.scheduler.stats for lp in table.all_loops()),
            eos_token_ids=self.eos_token_ids)
