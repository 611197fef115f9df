"""The HTTP API's server: uvicorn on the router's event loop (beside the gRPC server, no thread of
its own), on a socket bound here so that a bind error is the caller's ``ValueError``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import time
from typing import Any, Awaitable, Callable

import uvicorn

from ..rpc.grpc_server import EventLoopThread
from ..rpc.tls import TlsFiles, file_stamp

logger = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and without it the
    # small writes of a stream on a kept-alive connection wait ~40 ms on the client's delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot bind the HTTP server to {host}:{port}: {exc}") from exc
    sock.listen(2048)
    return sock


class HttpServer:
    def __init__(self, events: EventLoopThread, app: Callable[..., Awaitable[None]], host: str, port: int,
                 tls: TlsFiles | None = None) -> None:
        """Serve ``app`` on ``host:port`` (0: a free port; ``self.port`` is the bound one) from the event
        loop, over TLS with ``tls`` (its certificate re-read when the files change); returns once it accepts."""
        sock = bind(host, port)
        self.port: int = sock.getsockname()[1]
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_keep_alive=30,
                                backlog=2048, ssl_certfile=tls.cert if tls else None,
                                ssl_keyfile=tls.key if tls else None)
        self.server = uvicorn.Server(config)
        self.events = events
        self._done: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(
            self.server.serve(sockets=[sock]), events.loop)
        while not self.server.started and not self._done.done():
            time.sleep(0.01)
        if self._done.done():
            self._done.result()  # its error
            raise ValueError(f"the HTTP server on {host}:{port} stopped at start")
        self._reloader = (asyncio.run_coroutine_threadsafe(self._reload_certificate(tls), events.loop)
                          if tls is not None else None)

    async def _reload_certificate(self, tls: TlsFiles, every: float = 1.0) -> None:
        """Load the certificate into the server's SSL context again when its files change (new
        connections get it; open ones keep theirs)."""
        stamp = file_stamp(tls)
        while not self._done.done():
            await asyncio.sleep(every)
            try:
                now = file_stamp(tls)
                if now != stamp and self.server.config.ssl is not None:
                    self.server.config.ssl.load_cert_chain(tls.cert, tls.key)  # type: ignore[arg-type]
                    stamp = now
            except (OSError, ValueError) as exc:  # mid-rotation: try again
                logger.warning("TLS files unreadable, keeping the current certificate: %s", exc)

    def shutdown(self, grace: float, wait: bool = True) -> None:
        """Stop accepting, let responses in progress finish within ``grace`` seconds, then cancel them
        (``wait=False``: begin that and return)."""
        if self._reloader is not None:
            self._reloader.cancel()
        if self._done.done():
            return
        self.server.config.timeout_graceful_shutdown = max(int(grace), 1)
        self.server.should_exit = True
        if not wait:
            return
        try:
            self._done.result(timeout=grace + 10)
        except concurrent.futures.TimeoutError:
            pass
