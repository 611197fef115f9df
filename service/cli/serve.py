"""``modeserve serve``: the Generate API on one model. By default the engine is a child process
(``modeserve engine`` on loopback, stopped with the router; it cannot outlive it) and the router +
scheduler drive it over one Forward stream, so that streaming to clients and scheduling the next
step do not share a GIL; ``--no-engine-process`` keeps all three in one process."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

from .engine_args import add_engine_args, engine_kwargs
from .router import add_public_api_args
from .tls_args import add_tls_args, server_options, tls_files


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("serve", help="serve the Generate gRPC API on one model")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port (printed)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a child process (default on); off: router, scheduler and engine "
                        "in this one process")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule step N+1 while step N runs (default on)")
    p.add_argument("--max-queued-requests", type=int, default=1024)
    p.add_argument("--grace-period", type=float, default=30.0, help="seconds to finish streams on SIGTERM")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: a free one, announced on stdout)")
    add_public_api_args(p)
    add_tls_args(p, None)  # its engine is a child on loopback, in plaintext
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..router.app import serve_app
    from ..router.in_process import start_serve
    from ..rpc.grpc_server import grpc_address
    from ..router.api_key import load_api_key
    from .router import http_address

    if args.engine_process:
        return _run_over_engine_process(args)
    app = start_serve(grpc_address(args.host, args.port), args.model, overlap=args.overlap,
                      max_queued_requests=args.max_queued_requests, metrics_port=args.metrics_port,
                      http=http_address(args), api_key=load_api_key(args.api_key, args.api_key_file),
                      tls=tls_files(args), options=server_options(args), **engine_kwargs(args))
    return serve_app(app, "serve", args.host, args.grace_period)


def _run_over_engine_process(args: argparse.Namespace) -> int:
    """The router over a child engine; exit 1 if the engine exits first (the router then drains)."""
    from ..router.app import serve_app
    from ..router.remote import start_remote_router
    from ..rpc.engine_process import EngineProcess, EngineStartError
    from ..rpc.grpc_server import grpc_address
    from .router import router_config

    address = grpc_address(args.host, args.port)  # checked before the engine starts
    cfg = router_config(args)
    engine_failed = threading.Event()  # ends serve_app's wait, as SIGTERM does
    try:
        engine = EngineProcess(args.model, engine_kwargs(args), on_exit=lambda _: engine_failed.set())
    except EngineStartError as exc:  # the engine's own error is on stderr above
        print(f"modeserve: error: {exc}", file=sys.stderr)
        return exc.returncode if exc.returncode > 0 else 1
    try:
        app = start_remote_router(address, [engine.address], args.model, cfg)
        code = serve_app(app, "serve", args.host, args.grace_period, engine_failed)
    finally:
        engine.stop(args.grace_period)
    if engine_failed.is_set():
        print("modeserve: error: the engine process exited while serving", file=sys.stderr)
        return 1
    return code
