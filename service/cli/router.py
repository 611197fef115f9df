"""``modeserve router --engines host:port[,...]`` (or ``--engineset NAME`` in Kubernetes): the Generate
service over remote engine servers, one scheduler (and one Forward stream) per engine."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from ...engine.config import SchedulerConfig
from ..router.api_key import load_api_key
from ..router.app import HttpAddress, serve_app
from ..router.dispatch import POLICIES
from ..router.remote import RemoteRouterConfig, start_remote_router
from ..rpc.grpc_server import ServerOptions, grpc_address
from .engine_args import add_engine_args, engine_kwargs
from .tls_args import add_tls_args, server_options, tls_files

if TYPE_CHECKING:  # the kubernetes client is imported only when the router follows an EngineSet
    from ..router.engineset_watch import EngineSetWatch


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("router", help="serve Generate over remote engine servers")
    ranks = p.add_mutually_exclusive_group(required=True)
    ranks.add_argument("--engines", help="comma-separated host:port of engine servers (rank i: the i-th)")
    ranks.add_argument("--engineset", help="follow this EngineSet's rank table (status.ranks, published by the "
                                           "operator); needs get/list/watch on enginesets")
    p.add_argument("--namespace", default=None,
                   help="the EngineSet's namespace (default: $POD_NAMESPACE, else this pod's service account's)")
    p.add_argument("--model", default=None, help="where to load the tokenizer (default: the engine's model path)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-queued-requests", type=int, default=1024)
    p.add_argument("--grace-period", type=float, default=30.0)
    p.add_argument("--engine-wait", type=float, default=120.0, help="seconds to wait for engines to be SERVING")
    p.add_argument("--dispatch", choices=POLICIES, default="prefix",
                   help="prefix: longest cached prefix (ties and overload by load); least-loaded; round-robin")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: a free one, announced on stdout)")
    add_public_api_args(p)
    add_tls_args(p, "PEM CA of the engines' certificates: talk TLS to engines (presenting --tls-cert, for engines "
                    "that ask for mutual TLS)")
    p.add_argument("--admin-port", type=int, default=None,
                   help="serve the Admin API (SetRanks: where prompts go) on this port only, with --tls-ca to "
                        "clients with a certificate that CA signed (the operator); default: on --port, unguarded")
    p.add_argument("--dp-lockstep", action="store_true",
                   help="all ranks step together (IDLE when without work; CUDA-graph steps padded alike)")
    add_engine_args(p, (SchedulerConfig,))
    p.set_defaults(func=run)


def engineset_watch(name: str, namespace: str | None) -> EngineSetWatch:
    """The watch ``--engineset``/``--namespace`` ask for, with the environment's credentials."""
    try:
        from ..router.engineset_watch import EngineSetWatch, api_client_from_environment, pod_namespace
    except ImportError as exc:  # the kubernetes client comes with the `operator` extra (the image has it)
        raise ValueError(f"router: --engineset needs the kubernetes client (pip install 'modeserve[operator]'): "
                         f"{exc}") from exc

    namespace = namespace or pod_namespace()
    if not namespace:
        raise ValueError("router: --engineset needs --namespace (no $POD_NAMESPACE, no service account namespace)")
    return EngineSetWatch(api_client_from_environment(), namespace, name)


def add_public_api_args(p: argparse.ArgumentParser) -> None:
    """The flags of what clients reach (``serve`` and ``router``): the HTTP port, the API key."""
    p.add_argument("--http-port", type=int, default=8000, help="serve the OpenAI-compatible HTTP API on this port "
                                                               "(0: a free one, announced on stdout)")
    p.add_argument("--no-http", action="store_true", help="no HTTP API (gRPC only)")
    p.add_argument("--api-key", default=None, help="Generate calls and HTTP requests must carry "
                                                   "'authorization: Bearer KEY' (health stays open)")
    p.add_argument("--api-key-file", default=None, help="as --api-key, the key read from this file (a mounted Secret)")
    p.add_argument("--max-unsent-tokens", type=int, default=ServerOptions.max_unsent_tokens,
                   help="tokens generated and not yet read by their clients, all streams together (clients that do "
                        "not read their streams); past it the stream holding most is cancelled")


def http_address(args: argparse.Namespace) -> HttpAddress | None:
    if not 0 <= args.http_port < 65536:
        raise ValueError(f"--http-port must be in [0, 65536), got {args.http_port}")
    return None if args.no_http else HttpAddress(args.host, args.http_port)


def router_config(args: argparse.Namespace) -> RemoteRouterConfig:
    """The settings ``router`` and ``serve`` share: scheduler flags, ``--overlap``,
    ``--max-queued-requests``, ``--metrics-port``, ``--http-port``."""
    tls = tls_files(args)
    return RemoteRouterConfig(SchedulerConfig(**engine_kwargs(args, (SchedulerConfig,))), overlap=args.overlap,
                              max_queued_requests=args.max_queued_requests, metrics_port=args.metrics_port,
                              http=http_address(args), api_key=load_api_key(args.api_key, args.api_key_file),
                              tls=tls if tls is not None and tls.serves_tls else None,
                              engine_tls=tls if tls is not None and tls.ca is not None else None,
                              server=server_options(args))


def run(args: argparse.Namespace) -> int:
    watch = engineset_watch(args.engineset, args.namespace) if args.engineset else None
    engines = [e for e in (args.engines or "").split(",") if e]
    if args.admin_port is not None and not 0 <= args.admin_port < 65536:
        raise ValueError(f"--admin-port must be in [0, 65536), got {args.admin_port}")
    cfg = dataclasses.replace(router_config(args), wait=args.engine_wait, dispatch=args.dispatch,
                              lockstep=args.dp_lockstep, admin_port=args.admin_port)
    app = start_remote_router(grpc_address(args.host, args.port), engines, args.model, cfg, watch=watch)
    return serve_app(app, "router", args.host, args.grace_period)
