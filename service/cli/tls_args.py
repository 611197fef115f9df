"""The flags every gRPC server command shares: TLS (``--tls-cert``, ``--tls-key``, ``--tls-ca``), what
one client may hold (``--max-streams-per-connection``, ``--no-reflection``) and a plaintext health port
for probes (``--health-port``)."""

from __future__ import annotations

import argparse

from ..rpc.grpc_server import ServerOptions
from ..rpc.tls import TlsFiles


def add_tls_args(p: argparse.ArgumentParser, ca_help: str | None) -> None:
    """``ca_help`` None: the command takes no ``--tls-ca``."""
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (re-read when the file changes)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    if ca_help is not None:
        p.add_argument("--tls-ca", default=None, help=ca_help)
    p.add_argument("--max-streams-per-connection", type=int, default=ServerOptions.max_streams_per_connection,
                   help="concurrent gRPC streams one connection may hold (HTTP/2 MAX_CONCURRENT_STREAMS); more wait "
                        "at the client. Messages are capped at 64 MiB, prompts at --max-context-len tokens")
    p.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=True,
                   help="serve gRPC server reflection (default on)")
    p.add_argument("--health-port", type=int, default=None,
                   help="also serve gRPC health (only) on this port, in plaintext: for probes that speak no TLS "
                        "(the kubelet's gRPC probe) while the main port is TLS")


def server_options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(args.max_streams_per_connection, args.reflection, args.health_port,
                         getattr(args, "max_unsent_tokens", ServerOptions.max_unsent_tokens))


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The files given (``ValueError`` for a missing one or a lone cert/key); None for none."""
    ca = getattr(args, "tls_ca", None)
    if args.tls_cert is None and args.tls_key is None and ca is None:
        return None
    return TlsFiles(args.tls_cert, args.tls_key, ca)
