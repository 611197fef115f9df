"""``modeserve operator --namespaces a,b`` (a sub-command of ``service/cli``): the EngineSet operator
(kopf), standalone, one per cluster (the Helm chart runs one replica with ``Recreate``). Liveness on
``/healthz`` (port 8080 by default); the engines' and routers' image defaults to ``$MODESERVE_IMAGE``."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .reconcile import OperatorConfig


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("operator", help="run the EngineSet operator (kopf)")
    p.add_argument("--namespaces", required=True, help="comma-separated namespaces to watch (exact names)")
    p.add_argument("--reconcile-interval", type=float, default=15.0,
                   help="seconds between reconciles of each EngineSet's actual state (pods, router)")
    # its own dest: `modeserve --log-level` (before the sub-command) keeps working too
    p.add_argument("--log-level", dest="operator_log_level", default=None, help="DEBUG, INFO, WARNING, ...")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf's liveness endpoint")
    p.add_argument("--router-timeout", type=float, default=5.0, help="seconds per Admin call to a router")
    p.add_argument("--router-retry-delay", type=float, default=10.0,
                   help="seconds before retrying when a router does not answer")
    p.add_argument("--tls-ca", default=None, help="PEM CA of the routers' certificates: the Admin calls to routers of "
                   "EngineSets with spec.tls go over TLS")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate presented to those routers")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--router-service-account", default="",
                   help="routers run as this ServiceAccount (get/list/watch on enginesets) and follow their "
                        "EngineSet's rank table; empty: they learn it from the operator's SetRanks only")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace, env: Mapping[str, str]) -> OperatorConfig:
    """The operator's ``OperatorConfig`` from the command line and the environment."""
    from .reconcile import OperatorConfig

    return OperatorConfig(
        namespaces=tuple(ns.strip() for ns in args.namespaces.split(",") if ns.strip()),
        reconcile_interval=args.reconcile_interval,
        default_image=env.get("MODESERVE_IMAGE", ""),
        default_image_pull_policy=env.get("MODESERVE_IMAGE_PULL_POLICY") or "IfNotPresent",
        router_timeout=args.router_timeout,
        router_retry_delay=args.router_retry_delay,
        router_service_account=args.router_service_account,
    )


def run(args: argparse.Namespace) -> int:
    # kopf and the kubernetes client come with the `operator` extra: imported only here
    import kopf
    from .handlers import create_registry, operator_settings
    from .kube import Kube
    from .reconcile import EngineSetReconciler
    from .router_client import GrpcAdminClient
    from ..service.rpc.tls import TlsFiles

    if args.operator_log_level:
        logging.getLogger().setLevel(args.operator_log_level.upper())
    config = build_config(args, os.environ)
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_ca or args.tls_cert else None
    reconciler = EngineSetReconciler(config, Kube.from_environment(), GrpcAdminClient(config.router_timeout, tls))
    kopf.run(registry=create_registry(reconciler), settings=operator_settings(), standalone=True,
             clusterwide=False, namespaces=list(config.namespaces), liveness_endpoint=args.liveness)
    return 0
