"""``modeserve drain --server host:port``: tell an engine to drain and wait until its streams end
(the engine pod's preStop hook, so SIGTERM only comes once the engine is empty or time is up)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import grpc

from ...proto.v1 import engine_pb2, engine_pb2_grpc


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("drain", help="drain an engine and wait for its streams to end")
    p.add_argument("--server", default="127.0.0.1:50061")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the streams to end")
    p.set_defaults(func=run)


def drain(address: str, timeout: float) -> bool:
    """True when the engine reported no active stream within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        while True:
            try:
                reply = stub.Drain(engine_pb2.DrainRequest(), timeout=5)
            except grpc.RpcError:
                return True  # already gone
            if reply.drained or reply.active_streams == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    ok = drain(args.server, args.timeout)
    print("drained" if ok else "drain timed out", flush=True)
    return 0 if ok else 1
