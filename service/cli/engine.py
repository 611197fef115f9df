"""``modeserve engine``: serve one model runner over gRPC (``modeserve.v1.Engine``) until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from .engine_args import add_engine_args, engine_kwargs
from .tls_args import add_tls_args, server_options, tls_files

logger = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("engine", help="serve a model runner over gRPC (engine pod)")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port (printed on stdout)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: a free one, announced on stdout)")
    p.add_argument("--dp-rank", type=int, default=0, help="this engine's data-parallel rank (reported by Describe)")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight streams get to finish after SIGTERM")
    p.add_argument("--exit-on-stdin-eof", action="store_true",
                   help="stop as on SIGTERM when stdin closes (a parent holding the pipe: the engine ends with it)")
    add_tls_args(p, "PEM CA: mutual TLS, only clients (routers) with a certificate it signed get in")
    add_engine_args(p)
    p.set_defaults(func=run)


def exit_on_stdin_eof() -> None:
    """SIGTERM this process once stdin reaches EOF: the graceful stop once serving, else the default
    action (exit) while the model still loads."""

    def wait() -> None:
        while os.read(sys.stdin.fileno(), 4096):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="stdin-eof", daemon=True).start()


def run(args: argparse.Namespace) -> int:
    from ...engine.builder import build_engine
    from ..rpc.engine_server import create_engine_server
    from ..rpc.grpc_server import grpc_address, wait_for_signal

    if args.dp_rank < 0:
        raise ValueError(f"--dp-rank must be >= 0, got {args.dp_rank}")
    if args.grace_period < 0:
        raise ValueError(f"--grace-period must be >= 0, got {args.grace_period}")
    if args.exit_on_stdin_eof:
        exit_on_stdin_eof()
    address = grpc_address(args.host, args.port)
    tls = tls_files(args)
    if tls is not None and not tls.serves_tls:
        raise ValueError("engine: --tls-ca needs --tls-cert and --tls-key")
    parts = build_engine(args.model, **engine_kwargs(args))  # the same recipe as engine.LLM
    runner = parts.runner
    srv = create_engine_server(runner, address, model_path=str(parts.path), eos_token_ids=parts.eos_token_ids,
                               dp_rank=args.dp_rank, metrics_port=args.metrics_port, tls=tls,
                               options=server_options(args))
    host = address.rsplit(":", 1)[0]
    logger.info("engine rank %d: %s, %d KV slots, device %s", args.dp_rank, parts.checkpoint.config.name,
                runner.num_kv_slots, runner.device)

    def announce() -> None:
        print(f"modeserve engine listening on {host}:{srv.port}", flush=True)
        if srv.metrics is not None:
            print(f"modeserve engine metrics on {srv.metrics.host}:{srv.metrics.port}", flush=True)

    wait_for_signal(args.grace_period, ready=announce)
    srv.stop(args.grace_period)
    if parts.tp_workers is not None:  # after the last step: the other ranks of a tensor-parallel engine
        parts.tp_workers.close()
    sys.stdout.flush()
    return 0
