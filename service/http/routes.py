"""The OpenAI-compatible HTTP API (FastAPI) over the router's request path: ``/v1/chat/completions``,
``/v1/completions`` (whole or as Server-Sent Events), ``/v1/models``, ``/health``, ``/tokenize``,
``/detokenize``. A client that disconnects aborts its requests, as a cancelled gRPC stream does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import jinja2
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..router.api_key import bearer_ok
from ..router.generation import Delta, Generation, Usage
from ..router.rank_loop import QueueFullError
from ..router.request_handle import RequestHandle
from ..router.request_validation import FieldNames, InvalidField
from .errors import ApiError, BodyLimit, install_error_handlers
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest, SamplingFields, \
    TokenizeRequest
from .responses import ResponseFormat, merge_logprobs

T = TypeVar("T")
MAX_BODY_BYTES = 4 * 2**20


def sse(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None once the client has gone (``work`` then cancelled: its requests abort)."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    return task.result() if not task.cancelled() else None


async def merged(streams: Sequence[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of every choice as they come, with the choice's index."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        async for d in stream:
            queue.put_nowait((i, d))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, d = await queue.get()
            remaining -= d.finish_reason is not None
            yield i, d
    finally:
        for t in tasks:
            t.cancel()


class OpenAIApi:
    def __init__(self, generation: Generation) -> None:
        self.gen = generation
        self.parser = generation.parser

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.gen.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.gen.model_name!r}",
                           "model", "model_not_found")

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        tok = self.parser.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer: send token ids to /v1/completions", "messages")
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            self.parser.check_text("".join(m["content"] for m in conversation))
            return tok.apply_chat_template(conversation)
        except (ValueError, jinja2.TemplateError) as exc:
            raise ApiError(400, f"messages: {exc}", "messages") from exc

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        if self.parser.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids", "prompt")
        try:
            self.parser.check_text(prompt)
        except ValueError as exc:
            raise ApiError(400, f"prompt: {exc}", "prompt") from exc
        return self.parser.tokenizer.encode(prompt)

    def submit(self, body: SamplingFields, prompts: Sequence[list[int]], logprobs: int | None, max_tokens: int | None,
               names: FieldNames, request: Request, operation: str) -> list[RequestHandle]:
        """One request per prompt on the shared path; if one is refused, those already sent are aborted."""
        limits = self.parser.limits
        handles: list[RequestHandle] = []
        try:
            for ids in prompts:
                room = max(limits.max_context - len(ids), 1)
                n = max_tokens or min(room, limits.max_new_tokens or room)
                rid = f"{'chatcmpl' if operation == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
                trace = self.gen.trace(operation, request.headers.items(), n, body.temperature)
                handles.append(self.gen.submit(
                    lambda: self.parser.make_req(rid, ids, body.sampling(n, logprobs), names), trace))
        except BaseException as exc:
            for h in handles:
                self.gen.table.abort(h.req.rid)
            err = self._error(exc)
            if err is exc:
                raise
            raise err from exc
        return handles

    @staticmethod
    def _error(exc: BaseException) -> BaseException:
        if isinstance(exc, InvalidField):
            return ApiError(400, str(exc), exc.param)
        if isinstance(exc, LookupError):
            return ApiError(503, str(exc), code="unavailable")
        if isinstance(exc, QueueFullError):
            return ApiError(429, str(exc), code="queue_full")
        if isinstance(exc, ValueError):
            return ApiError(400, str(exc))
        return exc

    async def respond(self, request: Request, fmt: ResponseFormat, handles: list[RequestHandle], stream: bool,
                      include_usage: bool, prefixes: Sequence[str]) -> Response:
        """Stream the choices as SSE, or collect them into one JSON body."""
        arrived = time.perf_counter()
        streams = [self.gen.stream(h, arrived) for h in handles]
        if stream:
            return StreamingResponse(self._events(fmt, streams, include_usage, prefixes),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        body = await cancel_on_disconnect(request, self._collect(fmt, streams, prefixes))
        if body is None:
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(body)

    async def _collect(self, fmt: ResponseFormat, streams: list[AsyncGenerator[Delta, None]],
                       prefixes: Sequence[str]) -> dict[str, Any]:
        texts = list(prefixes)
        ids: list[list[int]] = [[] for _ in streams]
        parts: list[list[dict[str, Any] | None]] = [[] for _ in streams]
        last: list[Delta | None] = [None] * len(streams)
        async with contextlib.AsyncExitStack() as stack:
            for s in streams:
                await stack.enter_async_context(contextlib.aclosing(s))
            async for i, d in merged(streams):
                parts[i].append(fmt.logprobs(d, len(texts[i])))
                texts[i] += d.text
                ids[i] += d.token_ids
                last[i] = d
        if any(d is None or d.finish_reason == "abort" for d in last):
            raise ApiError(503, "the request was aborted (its engine failed)", code="aborted")
        return fmt.whole([(t, k, d, merge_logprobs(p)) for t, k, d, p in zip(texts, ids, last, parts) if d is not None])

    async def _events(self, fmt: ResponseFormat, streams: list[AsyncGenerator[Delta, None]], include_usage: bool,
                      prefixes: Sequence[str]) -> AsyncIterator[str]:
        offsets = [len(p) for p in prefixes]
        usages: list[Usage] = []
        async with contextlib.AsyncExitStack() as stack:
            for s in streams:
                await stack.enter_async_context(contextlib.aclosing(s))
            for i, prefix in enumerate(prefixes):
                if fmt.chat or prefix:
                    yield sse(fmt.chunk(i, None, prefix, first=True))
            async for i, d in merged(streams):
                yield sse(fmt.chunk(i, d, offset=offsets[i]))
                offsets[i] += len(d.text)
                if d.usage is not None:
                    usages.append(d.usage)
        if include_usage:
            yield sse(fmt.usage_chunk(usages))
        yield "data: [DONE]\n\n"

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        prompt = self.chat_prompt(body.messages)
        names = FieldNames(prompt="messages", max_new_tokens="max_tokens", stop_token_ids="stop_token_ids")
        handles = self.submit(body, [prompt], body.num_logprobs, body.requested_max_tokens, names, request, "chat")
        fmt = ResponseFormat(handles[0].req.rid, self.gen.model_name, self.parser.tokenizer, chat=True,
                             token_ids=body.return_token_ids)
        return await self.respond(request, fmt, handles, body.stream, body.include_usage, [""])

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (no prompt logprobs)", "echo")
        prompts = [self.text_prompt(p) for p in body.prompts]
        handles = self.submit(body, prompts, body.logprobs, body.max_tokens,
                              FieldNames(prompt="prompt", max_new_tokens="max_tokens", stop_token_ids="stop_token_ids"),
                              request, "text_completion")
        fmt = ResponseFormat(handles[0].req.rid, self.gen.model_name, self.parser.tokenizer, chat=False,
                             token_ids=body.return_token_ids)
        prefixes = [("" if not body.echo else p if isinstance(p, str) else self._echo(ids))
                    for p, ids in zip(body.prompts, prompts)]
        return await self.respond(request, fmt, handles, body.stream, body.include_usage, prefixes)

    def _echo(self, ids: list[int]) -> str:
        tok = self.parser.tokenizer
        return tok.decode(ids) if tok is not None else ""

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        ids = self.chat_prompt(body.messages) if body.messages is not None else self.text_prompt(body.prompt or "")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.parser.limits.max_context}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        tok = self.parser.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer", "tokens")
        try:
            return {"prompt": tok.decode(body.tokens)}
        except ValueError as exc:
            raise ApiError(400, f"tokens: {exc}", "tokens") from exc

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.gen.model_name, "object": "model", "created": 0,
                                            "owned_by": "modeserve", "max_model_len": self.parser.limits.max_context}]}

    def health(self) -> Response:
        if self.gen.draining or not self.gen.table.ready_loops():
            return JSONResponse({"status": "draining" if self.gen.draining else "no rank ready"}, status_code=503)
        return JSONResponse({"status": "ok"})


def key_check(key: str | None) -> list[Any]:
    """The dependency that refuses a request without ``Authorization: Bearer KEY`` (none without a key)."""
    if key is None:
        return []

    async def check(request: Request) -> None:
        if not bearer_ok(key, request.headers.get("authorization")):
            raise ApiError(401, "a valid API key is required: Authorization: Bearer <key>", code="invalid_api_key")

    return [Depends(check)]


def create_app(generation: Generation, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> Callable[..., Awaitable[None]]:
    """The ASGI app: FastAPI routes (all but /health asking for ``api_key`` if given) behind the body-size limit."""
    api = OpenAIApi(generation)
    app = FastAPI(title="modeserve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    guarded = key_check(api_key)
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"], dependencies=guarded)
    app.add_api_route("/v1/completions", api.completions, methods=["POST"], dependencies=guarded)
    app.add_api_route("/v1/models", api.models, methods=["GET"], dependencies=guarded)
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"], dependencies=guarded)
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"], dependencies=guarded)
    return BodyLimit(app, max_body_bytes)
