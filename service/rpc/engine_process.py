"""An engine server (``modeserve engine``) as a child process on loopback: engine args as its flags,
its address read from its ``listening on`` line, stopped with SIGTERM (the parts serve any
``modeserve`` child). The engine cannot outlive this process, even one killed with SIGKILL: its
stdin is a pipe only this process holds, and ``--exit-on-stdin-eof`` stops it when the pipe closes."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
import signal
import subprocess
import sys
import threading
from typing import Any, Callable

from ...engine.config import RunnerConfig, SchedulerConfig
from ...engine.python_child import python_argv

logger = logging.getLogger(__name__)


def engine_flags(engine_args: dict[str, Any],
                 classes: tuple[type, ...] = (RunnerConfig, SchedulerConfig)) -> list[str]:
    """The command-line flags of the ``engine_args`` that ``classes`` take (``cli/engine_args.py``'s
    names: ``page_size=16`` -> ``--page-size=16``, ``enable_mixed=False`` -> ``--no-enable-mixed``)."""
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    flags = []
    for name, value in sorted(engine_args.items()):
        if name not in names:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags.append(f"{flag}={value}")
    return flags


ANNOUNCED = {"listening": "grpc", "HTTP API": "http", "metrics": "metrics"}
_ANNOUNCE = re.compile(r"modeserve \S+ (listening|HTTP API|metrics) on (\S+):(\d+)")


def read_addresses(proc: subprocess.Popen[str], label: str, timeout: float, *also: str) -> dict[str, str]:
    """``127.0.0.1:PORT`` of each port a ``modeserve`` child announces on stdout: ``grpc`` from its first
    line (``... listening on HOST:PORT``), then ``http`` (``... HTTP API on``) and ``metrics`` (``... metrics
    on``) as ``also`` names them (and any read on the way), so a child given ``--http-port 0`` or
    ``--metrics-port 0`` binds a free port and says which. A child that exits, prints something else, or
    does not announce them all within ``timeout`` seconds is a RuntimeError."""
    unknown = set(also) - set(ANNOUNCED.values())
    if unknown:
        raise ValueError(f"no such announced port: {sorted(unknown)}")
    found: concurrent.futures.Future[dict[str, str]] = concurrent.futures.Future()
    # a thread, not select(): the lines come together, and a text stream's buffer holds those after the first
    threading.Thread(target=_read_announced, args=(proc, label, set(also), found), daemon=True,
                     name=f"{label}-announced").start()
    try:
        return found.result(timeout)
    except concurrent.futures.TimeoutError:
        raise RuntimeError(f"modeserve {label} did not announce its ports in {timeout} s "
                           f"(exit {proc.poll()})") from None


def _read_announced(proc: subprocess.Popen[str], label: str, also: set[str],
                    found: concurrent.futures.Future[dict[str, str]]) -> None:
    assert proc.stdout is not None
    addresses: dict[str, str] = {}
    while "grpc" not in addresses or not also <= addresses.keys():
        line = proc.stdout.readline()
        match = _ANNOUNCE.search(line)
        if match is None or ("grpc" not in addresses) != (match[1] == "listening"):
            found.set_exception(RuntimeError(f"modeserve {label} did not start (exit {proc.poll()}): {line!r}"))
            return
        addresses[ANNOUNCED[match[1]]] = f"127.0.0.1:{match[3]}"
    found.set_result(addresses)


def read_address(proc: subprocess.Popen[str], label: str, timeout: float) -> str:
    """``127.0.0.1:PORT`` of a ``modeserve`` child's gRPC port (``read_addresses``)."""
    return read_addresses(proc, label, timeout)["grpc"]


def stop_process(proc: subprocess.Popen[str], grace: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if it is still there after ``grace`` seconds; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


class EngineStartError(RuntimeError):
    """The engine exited before listening (its own error is on stderr), or was stopped for not
    listening in time; ``returncode``: its exit code."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


class EngineProcess:
    """``modeserve engine --model MODEL --host 127.0.0.1 --port 0`` of this interpreter with
    ``engine_args`` as flags, serving once the constructor returns. ``on_exit(code)`` is called (from a watcher thread) if the engine
    exits before ``stop``."""

    def __init__(self, model: str | None, engine_args: dict[str, Any], env: dict[str, str] | None = None,
                 start_timeout: float = 600.0, on_exit: Callable[[int], None] | None = None) -> None:
        argv = [*python_argv("-m", "modeserve.service.cli", "engine"), *(["--model", model] if model else []),
                "--host", "127.0.0.1", "--port", "0", "--exit-on-stdin-eof", *engine_flags(engine_args)]
        # a session of its own: a terminal's Ctrl-C reaches the parent only, which drains, then stops it
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                      start_new_session=True)
        self._stopping = False
        try:
            self.address = read_address(self._proc, "engine", start_timeout)
        except BaseException as exc:
            code = self.stop(5.0)
            if isinstance(exc, RuntimeError):
                raise EngineStartError(f"modeserve engine did not start (exit {code})", code) from exc
            raise
        self._watcher = threading.Thread(target=self._watch, args=(on_exit,), name="engine-process", daemon=True)
        self._watcher.start()

    def _watch(self, on_exit: Callable[[int], None] | None) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:  # drained, so that the engine never blocks on a full pipe
            sys.stderr.write(line)
        code = self._proc.wait()
        if not self._stopping:
            logger.error("engine process %d exited unexpectedly (code %d)", self._proc.pid, code)
            if on_exit is not None:
                on_exit(code)

    def stop(self, grace: float = 30.0) -> int:
        """SIGTERM: the engine finishes its streams within ``grace`` seconds (then SIGKILL); the exit code."""
        self._stopping = True
        code = stop_process(self._proc, grace)
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        return code
