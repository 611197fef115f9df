"""``modeserve serve``: router + scheduler + engine in one process (in-process transport)."""

from __future__ import annotations

import argparse
from typing import Any

from .engine_args import add_engine_args, engine_kwargs


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("serve", help="serve the Generate gRPC API in one process")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port (printed)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule step N+1 while step N runs (default on)")
    p.add_argument("--max-queued-requests", type=int, default=1024)
    p.add_argument("--grace-period", type=float, default=30.0, help="seconds to finish streams on SIGTERM")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..router.app import serve_app
    from ..router.in_process import start_serve
    from ..rpc.grpc_server import grpc_address

    app = start_serve(grpc_address(args.host, args.port), args.model, overlap=args.overlap,
                      max_queued_requests=args.max_queued_requests, metrics_port=args.metrics_port,
                      **engine_kwargs(args))
    return serve_app(app, "serve", args.host, args.grace_period)
