"""``modeserve serve`` / ``router`` / ``engine`` as child processes on loopback, for the load benches
and tests: started, waited for (the ports they announce), stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import subprocess
from typing import Any, Iterator, NamedTuple, Sequence

from ...engine.config import SchedulerConfig
from ...engine.python_child import python_argv
from ..rpc.engine_process import engine_flags, read_addresses, stop_process


def rss_mib(pid: int) -> float:
    """The process's resident set (``VmRSS`` of ``/proc/PID/status``) in MiB; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0
    return kib / 1024


@contextlib.contextmanager
def child(*args: str, env: dict[str, str] | None = None, start_timeout: float = 600.0,
          announced: Sequence[str] = ()) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """Run ``modeserve <args>`` (which must take ``--port 0``; ``serve`` and ``router`` without the HTTP
    API unless ``args`` name an ``--http-port``) and yield the process and its ``127.0.0.1:PORT``s:
    ``grpc``, and those ``announced`` names (``http``, ``metrics``: give their ports as 0, and each is bound
    by the child itself, so that no other process can take it between a pick and a bind)."""
    http = [] if args[0] == "engine" or "--http-port" in args else ["--no-http"]
    proc = subprocess.Popen([*python_argv("-m", "modeserve.service.cli"), *args, *http, "--host", "127.0.0.1",
                             "--port", "0"], stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    try:
        yield proc, read_addresses(proc, args[0], start_timeout, *announced)
    finally:
        stop_process(proc)


@contextlib.contextmanager
def spawn(*args: str, env: dict[str, str] | None = None, start_timeout: float = 600.0) -> Iterator[str]:
    """``child``, yielding only the gRPC address."""
    with child(*args, env=env, start_timeout=start_timeout) as (_, addresses):
        yield addresses["grpc"]


class Front(NamedTuple):
    """Where clients reach a server: gRPC, and the HTTP API if it serves one (``127.0.0.1:PORT``)."""
    grpc: str
    http: str | None = None


@contextlib.contextmanager
def _front(*args: str, http: bool, env: dict[str, str] | None) -> Iterator[Front]:
    """``child`` of a ``serve`` or ``router``, with the HTTP API on a port of its own choosing if ``http``."""
    with child(*args, *(["--http-port", "0"] if http else []), env=env,
               announced=["http"] if http else []) as (_, addresses):
        yield Front(addresses["grpc"], addresses.get("http"))


def serve(model: str, engine_args: dict[str, Any], max_queued_requests: int,
          env: dict[str, str] | None = None, http: bool = False) -> contextlib.AbstractContextManager[Front]:
    """One ``modeserve serve`` process (by default its engine a child process of it)."""
    return _front("serve", "--model", model, "--max-queued-requests", str(max_queued_requests), "--grace-period", "5",
                  *engine_flags(engine_args), http=http, env=env)


@contextlib.contextmanager
def router_and_engine(model: str, engine_args: dict[str, Any], max_queued_requests: int,
                      env: dict[str, str] | None = None, http: bool = False) -> Iterator[Front]:
    """A ``modeserve engine`` process and a ``modeserve router`` process over it; yields the router's."""
    with spawn("engine", "--model", model, "--grace-period", "5", *engine_flags(engine_args), env=env) as engine:
        with _front("router", "--engines", engine, "--max-queued-requests", str(max_queued_requests),
                    "--grace-period", "5", *engine_flags(engine_args, (SchedulerConfig,)), http=http, env=env) as front:
            yield front


def server(target: str, model: str, engine_args: dict[str, Any], max_queued_requests: int,
           env: dict[str, str] | None = None, http: bool = False) -> contextlib.AbstractContextManager[Front]:
    """``serve`` or ``router`` (over one engine), as ``--target`` names them (with the HTTP API if
    ``http``)."""
    if target == "serve":
        return serve(model, engine_args, max_queued_requests, env, http)
    if target == "router":
        return router_and_engine(model, engine_args, max_queued_requests, env, http)
    raise ValueError(f"unknown target {target!r} (serve, router)")
