"""Every modeserve gRPC server: an asyncio server (``grpc.aio``) on an event-loop thread with health
(liveness ``""`` + readiness per service), reflection and a graceful stop; and what a serving process
does around it (its start-up heap frozen, SIGTERM/SIGINT awaited)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .undecodable import UndecodableInterceptor

logger = logging.getLogger(__name__)

T = TypeVar("T")
MAX_MESSAGE_BYTES = 64 * 2**20
MAX_PENDING_CALLS = 1 << 20
# gRPC core binds with SO_REUSEPORT by default: a second server on a taken port would start and get a share
# of its connections (two engines answering at one address). Off, that bind fails as it should.
NO_SHARED_PORT = ("grpc.so_reuseport", 0)


@dataclass(frozen=True)
class ServerOptions:
    """What one client may hold open on a server, whether it describes itself, and where probes ask
    for its health without TLS."""

    max_streams_per_connection: int = 4096  # HTTP/2 MAX_CONCURRENT_STREAMS: a client's streams past it wait
    reflection: bool = True
    # a second, plaintext port serving only grpc.health.v1 (the kubelet's gRPC probes speak no TLS)
    health_port: int | None = None
    # a router's tokens generated and not yet taken by their clients, all streams together: past it the
    # stream holding most is cancelled (router.backlog)
    max_unsent_tokens: int = 1 << 16

    def __post_init__(self) -> None:
        if self.max_streams_per_connection < 1:
            raise ValueError(f"--max-streams-per-connection must be >= 1, got {self.max_streams_per_connection}")
        if self.health_port is not None and not 0 <= self.health_port < 65536:
            raise ValueError(f"--health-port must be in [0, 65536), got {self.health_port}")
        if self.max_unsent_tokens < 1:
            raise ValueError(f"--max-unsent-tokens must be >= 1, got {self.max_unsent_tokens}")


def grpc_address(host: str, port: int) -> str:
    if not 0 <= port < 65536:
        raise ValueError(f"--port must be in [0, 65536), got {port}")
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bound_port(add_port: Callable[[], int]) -> int:
    """The port ``add_port`` bound, 0 where it bound none (grpc-python raises RuntimeError where gRPC
    core returns 0, depending on the failure)."""
    try:
        return add_port()
    except RuntimeError:
        return 0


class EventLoopThread:
    """An asyncio event loop running on its own thread; other threads hand it work."""

    def __init__(self, name: str = "grpc-aio") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float | None = 60) -> T:
        """Run ``coro`` on the loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def post(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop soon (from any thread; ``RuntimeError`` once it is closed)."""
        self.loop.call_soon_threadsafe(callback)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class GrpcServer:
    def __init__(self, loop: EventLoopThread, address: str, register: Sequence[Callable[[grpc.aio.Server], None]],
                 service_names: Sequence[str], interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 credentials: grpc.ServerCredentials | None = None, options: ServerOptions = ServerOptions()) -> None:
        """Build and start the server on ``loop`` at ``address`` (``host:0`` picks a free port), over
        TLS with ``credentials``; ``ValueError`` when it cannot bind."""
        self.service_names = tuple(service_names)
        self.events = loop
        self.options = options
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        self.port = loop.run(self._start(address, register, interceptors, credentials))

    async def _start(self, address: str, register: Sequence[Callable[[grpc.aio.Server], None]],
                     interceptors: Sequence[grpc.aio.ServerInterceptor],
                     credentials: grpc.ServerCredentials | None) -> int:
        # innermost: a caller refused by an outer interceptor (the API key) hears that first
        self.server = grpc.aio.server(interceptors=[*interceptors, UndecodableInterceptor()], options=[
            ("grpc.max_concurrent_streams", self.options.max_streams_per_connection),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # gRPC core cancels calls that wait unmatched while more than its default of pending ones
            # queue (a burst of streams on a busy loop); admission here is --max-queued-requests
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS), NO_SHARED_PORT])
        for add in register:
            add(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.options.reflection:
            reflection.enable_server_reflection((*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                                self.server)
        server = self.server
        port = bound_port(lambda: server.add_secure_port(address, credentials) if credentials is not None
                          else server.add_insecure_port(address))
        if port == 0:
            await self.server.stop(0)
            raise ValueError(f"cannot bind gRPC server to {address!r}")
        await self.server.start()
        if self.options.health_port is not None:
            await self._start_health(address.rsplit(":", 1)[0], self.options.health_port)
        await self._set_serving(True)
        return port

    async def _start_health(self, host: str, port: int) -> None:
        """The same health states on a plaintext port of their own, nothing else served there."""
        self.health_server = grpc.aio.server(options=[NO_SHARED_PORT])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        health_server = self.health_server
        bound = bound_port(lambda: health_server.add_insecure_port(f"{host}:{port}"))
        if bound == 0:
            await self.health_server.stop(0)
            await self.server.stop(0)
            raise ValueError(f"cannot bind the health port {host}:{port}")
        await self.health_server.start()
        self.health_port = bound

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def set_not_serving(self, service: str) -> None:
        """One service NOT_SERVING (an engine that drains: readiness), the others as they are."""
        await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    def shutdown(self, grace: float) -> None:
        """Report NOT_SERVING, refuse new RPCs, let in-flight ones finish within ``grace`` seconds."""
        if self.events.loop.is_closed():
            return
        try:
            self.events.run(self._stop(grace), timeout=grace + 30)
        except concurrent.futures.TimeoutError:
            pass

    async def _stop(self, grace: float) -> None:
        await self._set_serving(False)
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)


def freeze_startup_heap() -> None:
    """Collect once, then put everything alive after start-up (torch, the model's modules, the
    tokenizer) out of the collector's reach: a full collection while serving then walks only what
    serving allocated, instead of pausing every in-flight stream for the whole heap."""
    gc.collect()
    gc.freeze()


def wait_for_signal(grace: float, stop: threading.Event | None = None,
                    ready: Callable[[], None] | None = None) -> None:
    """Block until SIGTERM/SIGINT, or until ``stop`` is set. First the handlers are set and the heap of
    start-up frozen, then ``ready`` runs (announcing the ports: a SIGTERM sent as soon as a client reads
    them drains rather than kills)."""
    signalled = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        logger.info("signal %d: draining (grace %.0fs)", signum, grace)
        signalled.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    freeze_startup_heap()
    if ready is not None:
        ready()
    # Python runs signal handlers in the main thread, but the kernel may deliver SIGTERM to any thread
    # (gRPC's, torch's); a main thread blocked in an untimed wait is then never woken to run the
    # handler and the process ignores SIGTERM. A timed wait returns to the interpreter, which runs it.
    while not signalled.wait(timeout=0.2) and not (stop is not None and stop.is_set()):
        pass
