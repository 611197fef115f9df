"""A ``modeserve`` child binds every port it is given as 0 itself and announces it on stdout;
``read_addresses`` reads them back. (Before, the benches and the HTTP tests picked a free port, closed
it, and passed it on: another process could bind it in between.)"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from modeserve.service.rpc.engine_process import read_addresses, stop_process


def _printer(*lines: str, then_sleep: float = 30.0) -> subprocess.Popen[str]:
    """A child that writes ``lines`` in one write (so that they arrive together) and then sleeps."""
    text = "".join(line + "\n" for line in lines)
    code = f"import sys, time; sys.stdout.write({text!r}); sys.stdout.flush(); time.sleep({then_sleep})"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_lines_that_arrive_together_are_all_read() -> None:
    proc = _printer("modeserve router listening on 127.0.0.1:5001", "modeserve router HTTP API on 127.0.0.1:5002",
                    "modeserve router metrics on 0.0.0.0:5003")
    try:
        assert read_addresses(proc, "router", 10, "metrics") == {  # and the HTTP line read on the way
            "grpc": "127.0.0.1:5001", "http": "127.0.0.1:5002", "metrics": "127.0.0.1:5003"}
    finally:
        stop_process(proc, 1)
    proc = _printer("modeserve serve listening on [::1]:6001", "modeserve serve HTTP API on [::1]:6002")
    try:
        assert read_addresses(proc, "serve", 10, "http") == {"grpc": "127.0.0.1:6001", "http": "127.0.0.1:6002"}
    finally:
        stop_process(proc, 1)


@pytest.mark.parametrize("lines, match", [
    ((), "did not start"),  # exits before a line
    (("Traceback (most recent call last):",), "did not start"),
    (("modeserve serve HTTP API on 127.0.0.1:1",), "did not start"),  # gRPC must come first
    (("modeserve serve listening on 127.0.0.1:1",), "did not start"),  # exits before the HTTP line it was asked for
])
def test_a_child_that_does_not_announce_is_an_error(lines: tuple[str, ...], match: str) -> None:
    proc = _printer(*lines, then_sleep=0)
    try:
        with pytest.raises(RuntimeError, match=match):
            read_addresses(proc, "serve", 10, "http")
    finally:
        stop_process(proc, 1)


def test_a_silent_child_times_out() -> None:
    proc = _printer("modeserve serve listening on 127.0.0.1:1")
    try:
        with pytest.raises(RuntimeError, match="did not announce its ports in 0.5 s"):
            read_addresses(proc, "serve", 0.5, "metrics")
    finally:
        stop_process(proc, 1)
    with pytest.raises(ValueError, match="no such announced port"):
        read_addresses(proc, "serve", 1, "admin")


def test_engine_binds_its_metrics_port_and_announces_it(tiny_model: Path) -> None:
    """``modeserve engine --metrics-port 0``: /metrics answers on the port it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "modeserve.service.cli", "engine", "--model", str(tiny_model),
                             "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace-period", "1"],
                            stdout=subprocess.PIPE, text=True)
    try:
        at = read_addresses(proc, "engine", 300, "metrics")
        assert at["grpc"] != at["metrics"]
        body = urllib.request.urlopen(f"http://{at['metrics']}/metrics", timeout=10).read().decode()
        assert "modeserve_forward_steps" in body
    finally:
        assert stop_process(proc) == 0


def test_no_http_serves_grpc_only(tiny_model: Path) -> None:
    """``serve --no-http``: the gRPC line and nothing after it; ``--http-port 0`` is a free port, not off.
    SIGTERM at once after the line drains (exit 0): the handler is set before the line is printed."""
    from modeserve.service.cli import build_parser
    from modeserve.service.cli.router import http_address

    args = build_parser().parse_args(["serve", "--http-port", "0", "--host", "127.0.0.1"])
    assert http_address(args) == ("127.0.0.1", 0)
    assert http_address(build_parser().parse_args(["serve", "--no-http"])) is None
    with pytest.raises(ValueError, match="--http-port must be in"):
        http_address(build_parser().parse_args(["serve", "--http-port", "70000"]))
    proc = subprocess.Popen([sys.executable, "-m", "modeserve.service.cli", "serve", "--model", str(tiny_model),
                             "--host", "127.0.0.1", "--port", "0", "--no-http", "--grace-period", "1"],
                            stdout=subprocess.PIPE, text=True)
    try:
        read_addresses(proc, "serve", 300)
        assert stop_process(proc) == 0
        assert proc.stdout is not None and proc.stdout.read() == ""
    finally:
        stop_process(proc)
