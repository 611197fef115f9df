"""A request whose bytes do not parse gets INVALID_ARGUMENT on every modeserve gRPC server.

grpc-python's aio server would answer such a unary request UNKNOWN ("Unexpected DecodeError") before
any handler runs: the request deserializer raises. ``UndecodableInterceptor`` gives each method with a
single request a deserializer that hands the parse error on as a value, and a behaviour that ends the
call INVALID_ARGUMENT on it. A method that takes a stream of requests sees the error raised from its
request iterator: the engine's Forward answers it itself (after the results of the batches before
it); one that lets it escape (gRPC reflection) ends INVALID_ARGUMENT here.
"""

from __future__ import annotations

import inspect
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError


class Undecodable:
    """What a request that did not parse becomes: the parser's message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return Undecodable(str(exc))
    return parse


async def _refuse(request: Undecodable, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request does not parse: {request.error}")


def _unary(inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(request, context)
        return await inner(request, context)
    return behaviour


async def _relay(out: Any) -> AsyncIterator[Any]:
    """A streaming behaviour's answer: an async generator's items, or a coroutine that writes with
    ``context.write`` itself (health's Watch) run to its end."""
    if inspect.isasyncgen(out):
        async for item in out:
            yield item
    else:
        await out


def _server_streaming(inner: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
    async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await _refuse(request, context)
        async for item in _relay(inner(request, context)):
            yield item
    return behaviour


def _client_streaming(inner: Callable[..., Any], streams_out: bool) -> Callable[..., Any]:
    """Around a behaviour over a request iterator: a parse error escaping it ends the call INVALID_ARGUMENT."""
    async def stream_out(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in _relay(inner(requests, context)):
                yield item
        except DecodeError as exc:
            await _refuse(Undecodable(str(exc)), context)

    async def unary_out(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        try:
            return await inner(requests, context)
        except DecodeError as exc:
            await _refuse(Undecodable(str(exc)), context)

    return stream_out if streams_out else unary_out


class UndecodableInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _client_streaming(handler.stream_stream, True), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _client_streaming(handler.stream_unary, False), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        codec = dict(request_deserializer=_tolerant(handler.request_deserializer),
                     response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_server_streaming(handler.unary_stream), **codec)
        return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary), **codec)
