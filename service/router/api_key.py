"""The optional API key of the public APIs: ``authorization: Bearer KEY`` on ``modeserve.v1.Generate``
calls (gRPC metadata) and on HTTP requests, compared in constant time. Health and reflection stay
open, for probes."""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import grpc

GUARDED_SERVICES = ("modeserve.v1.Generate",)
REFUSAL = "a valid API key is required: authorization: Bearer <key>"


def load_api_key(key: str | None, key_file: str | None) -> str | None:
    """``--api-key`` or the first line of ``--api-key-file`` (a mounted Secret); None: no key asked."""
    if key and key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if key_file:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file: {exc}") from exc
        if not key:
            raise ValueError(f"--api-key-file: {key_file} is empty")
    return key or None


def bearer_ok(key: str, authorization: str | None) -> bool:
    """Whether the header carries ``key`` (constant time in the key's length)."""
    return authorization is not None and hmac.compare_digest(authorization.encode(), f"Bearer {key}".encode())


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


async def _refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
    yield  # never reached: this makes it a server-streaming behaviour


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with UNAUTHENTICATED."""
    codec = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_refuse_stream, **codec)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(_refuse_stream, **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_refuse, **codec)
    return grpc.unary_unary_rpc_method_handler(_refuse, **codec)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, key: str, services: Sequence[str] = GUARDED_SERVICES) -> None:
        self._key = key
        self._prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefixes):  # type: ignore[attr-defined]
            return handler
        metadata = dict(details.invocation_metadata or ())  # type: ignore[attr-defined]
        auth = metadata.get("authorization")
        return handler if bearer_ok(self._key, auth if isinstance(auth, str) else None) else _refusing(handler)
