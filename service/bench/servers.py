"""``modeserve serve`` / ``router`` / ``engine`` as child processes on loopback, for the load benches
and tests: started, waited for (their ``listening on`` line), stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any, Iterator

from ...engine.config import SchedulerConfig

_SCHEDULER_FIELDS = set(SchedulerConfig.__dataclass_fields__)


def engine_flags(engine_args: dict[str, Any], scheduler_only: bool = False) -> list[str]:
    """Command-line flags of ``engine_args`` (the names of ``cli/engine_args.py``)."""
    flags = []
    for name, value in sorted(engine_args.items()):
        if scheduler_only and name not in _SCHEDULER_FIELDS:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags.append(f"{flag}={value}")
    return flags


@contextlib.contextmanager
def spawn(*args: str, env: dict[str, str] | None = None, start_timeout: float = 600.0) -> Iterator[str]:
    """Run ``modeserve <args>`` (which must take ``--port 0``) and yield its ``127.0.0.1:PORT``."""
    proc = subprocess.Popen([sys.executable, "-m", "modeserve.service.cli", *args, "--host", "127.0.0.1",
                             "--port", "0"], stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    try:
        assert proc.stdout is not None
        line = _readline(proc, start_timeout)
        if "listening on" not in line:
            raise RuntimeError(f"modeserve {args[0]} did not start (exit {proc.poll()}): {line!r}")
        yield f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}"
    finally:
        stop(proc)


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    """The first stdout line, or '' after ``timeout`` seconds (a hung start fails, not blocks)."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return ""
    return proc.stdout.readline()


def stop(proc: subprocess.Popen[str], grace: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if it is still there after ``grace`` seconds; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


@contextlib.contextmanager
def serve(model: str, engine_args: dict[str, Any], max_queued_requests: int,
          env: dict[str, str] | None = None) -> Iterator[str]:
    """One ``modeserve serve`` process (router + scheduler + engine)."""
    with spawn("serve", "--model", model, "--max-queued-requests", str(max_queued_requests), "--grace-period", "5",
               *engine_flags(engine_args), env=env) as address:
        yield address


@contextlib.contextmanager
def router_and_engine(model: str, engine_args: dict[str, Any], max_queued_requests: int,
                      env: dict[str, str] | None = None) -> Iterator[str]:
    """A ``modeserve engine`` process and a ``modeserve router`` process over it; yields the router."""
    with spawn("engine", "--model", model, "--grace-period", "5", *engine_flags(engine_args), env=env) as engine:
        with spawn("router", "--engines", engine, "--max-queued-requests", str(max_queued_requests),
                   "--grace-period", "5", *engine_flags(engine_args, scheduler_only=True), env=env) as router:
            yield router


def server(target: str, model: str, engine_args: dict[str, Any], max_queued_requests: int,
           env: dict[str, str] | None = None) -> contextlib.AbstractContextManager[str]:
    """``serve`` or ``router`` (over one engine), as ``--target`` names them."""
    if target == "serve":
        return serve(model, engine_args, max_queued_requests, env)
    if target == "router":
        return router_and_engine(model, engine_args, max_queued_requests, env)
    raise ValueError(f"unknown target {target!r} (serve, router)")
