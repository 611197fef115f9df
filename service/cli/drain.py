"""``modeserve drain --server host:port``: tell an engine to drain and wait until its streams end
(the engine pod's preStop hook, so SIGTERM only comes once the engine is empty or time is up); over
(mutual) TLS with ``--tls-ca`` (and ``--tls-cert``/``--tls-key``)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import grpc

from ...proto.v1 import engine_pb2, engine_pb2_grpc
from ..rpc.tls import TlsFiles, open_channel


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("drain", help="drain an engine and wait for its streams to end")
    p.add_argument("--server", default="127.0.0.1:50061")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the streams to end")
    p.add_argument("--tls-ca", default=None, help="PEM CA of the engine's certificate: connect over TLS")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate (an engine with mutual TLS asks for one)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.set_defaults(func=run)


def drain(address: str, timeout: float, tls: TlsFiles | None = None) -> bool:
    """True when the engine reported no active stream within ``timeout`` seconds (over TLS with ``tls``)."""
    deadline = time.monotonic() + timeout
    with open_channel(address, tls) as channel:
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
    given = args.tls_ca is not None or args.tls_cert is not None
    ok = drain(args.server, args.timeout, TlsFiles(args.tls_cert, args.tls_key, args.tls_ca) if given else None)
    print("drained" if ok else "drain timed out", flush=True)
    return 0 if ok else 1
