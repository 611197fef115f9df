"""``modeserve serve`` / ``router`` / ``engine`` as child processes on loopback, for the load benches
and tests: started, waited for (their ``listening on`` line), stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from typing import Any, Iterator

from ...engine.config import SchedulerConfig
from ...engine.python_child import python_argv
from ..rpc.engine_process import engine_flags, read_address, stop_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    """The process's resident set (``VmRSS`` of ``/proc/PID/status``) in MiB; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0
    return kib / 1024


@contextlib.contextmanager
def child(*args: str, env: dict[str, str] | None = None,
          start_timeout: float = 600.0) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Run ``modeserve <args>`` (which must take ``--port 0``; ``serve`` and ``router`` without the HTTP
    API unless ``args`` name an ``--http-port``) and yield the process and its ``127.0.0.1:PORT``."""
    http = [] if args[0] == "engine" or "--http-port" in args else ["--http-port", "0"]
    proc = subprocess.Popen([*python_argv("-m", "modeserve.service.cli"), *args, *http, "--host", "127.0.0.1",
                             "--port", "0"], stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    try:
        yield proc, read_address(proc, args[0], start_timeout)
    finally:
        stop_process(proc)


@contextlib.contextmanager
def spawn(*args: str, env: dict[str, str] | None = None, start_timeout: float = 600.0) -> Iterator[str]:
    """``child``, yielding only the address."""
    with child(*args, env=env, start_timeout=start_timeout) as (_, address):
        yield address


@contextlib.contextmanager
def serve(model: str, engine_args: dict[str, Any], max_queued_requests: int,
          env: dict[str, str] | None = None, http_port: int = 0) -> Iterator[str]:
    """One ``modeserve serve`` process (by default its engine a child process of it)."""
    with spawn("serve", "--model", model, "--max-queued-requests", str(max_queued_requests), "--grace-period", "5",
               "--http-port", str(http_port), *engine_flags(engine_args), env=env) as address:
        yield address


@contextlib.contextmanager
def router_and_engine(model: str, engine_args: dict[str, Any], max_queued_requests: int,
                      env: dict[str, str] | None = None, http_port: int = 0) -> Iterator[str]:
    """A ``modeserve engine`` process and a ``modeserve router`` process over it; yields the router."""
    with spawn("engine", "--model", model, "--grace-period", "5", *engine_flags(engine_args), env=env) as engine:
        with spawn("router", "--engines", engine, "--max-queued-requests", str(max_queued_requests),
                   "--grace-period", "5", "--http-port", str(http_port), *engine_flags(engine_args, (SchedulerConfig,)), env=env) as router:
            yield router


def server(target: str, model: str, engine_args: dict[str, Any], max_queued_requests: int,
           env: dict[str, str] | None = None, http_port: int = 0) -> contextlib.AbstractContextManager[str]:
    """``serve`` or ``router`` (over one engine), as ``--target`` names them (the HTTP API on
    ``http_port``, if not 0)."""
    if target == "serve":
        return serve(model, engine_args, max_queued_requests, env, http_port)
    if target == "router":
        return router_and_engine(model, engine_args, max_queued_requests, env, http_port)
    raise ValueError(f"unknown target {target!r} (serve, router)")
