"""Every HTTP error as OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``):
bad bodies 400 naming the field, no API key 401, unknown models 404, oversized bodies 413, a full queue 429, a
draining router 503."""

from __future__ import annotations

import json
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "list", "dict"})


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def param_of(loc: Sequence[int | str]) -> str | None:
    """``("body", "messages", 0, "role")`` → ``"messages[0].role"`` (a union's branch names left out)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.isidentifier() or part in UNION_MEMBERS:  # pydantic's name of a union's branch
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        param = param_of(first.get("loc", ()))
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (declared or streamed) gets 413 before any
    handler reads it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:  # read the body here, so that its size is known before the app sees it
            message = await receive()
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(receive, send, message, size)
                return
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Receive, send: Send, message: Message, size: int) -> None:
        """413, after reading the rest of the body (up to 16 times the limit) so that the client, still
        sending, reads the answer instead of a reset connection."""
        while message.get("more_body") and size < 16 * self.max_bytes:
            message = await receive()
            size += len(message.get("body", b""))
        body = json.dumps(error_body(413, f"the request body is over the limit of {self.max_bytes} bytes")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
