"""The ``modeserve`` command: one sub-command per job."""

from __future__ import annotations

import argparse
import logging
import sys

from ..rpc import client
from ...operator import cli as operator
from ..bench import cli as bench
from . import drain, engine, generate, router, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modeserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO (one line per step), WARNING, ...")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    bench.add_parser(sub)
    serve.add_parser(sub)
    router.add_parser(sub)
    client.add_parser(sub)
    engine.add_parser(sub)
    drain.add_parser(sub)
    operator.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"modeserve: error: {exc}", file=sys.stderr)
        return 2

