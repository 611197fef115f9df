"""Command-line flags generated from the engine config dataclasses, so CLI flags, Helm values and
operator-made pod arguments share one set of names (``--page-size`` <-> ``page_size``)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from ...engine.config import RunnerConfig, SchedulerConfig

_SKIP = {"model"}  # given explicitly by each command


def _flag_type(hint: Any) -> tuple[type, bool]:
    """(scalar type, optional) of a field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:
        return args[0], True
    return hint, False


ConfigClasses = tuple[type, ...]
ALL: ConfigClasses = (RunnerConfig, SchedulerConfig)


def add_engine_args(parser: argparse.ArgumentParser, classes: ConfigClasses = ALL) -> None:
    group = parser.add_argument_group("engine")
    seen: set[str] = set()
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in _SKIP or f.name in seen:
                continue
            seen.add(f.name)
            kind, _ = _flag_type(hints[f.name])
            flag = "--" + f.name.replace("_", "-")
            if kind is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
            else:
                group.add_argument(flag, dest=f.name, type=kind, default=None,
                                   help=f"default: {f.default}")


def engine_kwargs(args: argparse.Namespace, classes: ConfigClasses = ALL) -> dict[str, Any]:
    """The engine flags the user set (unset ones keep the config defaults)."""
    names = {f.name for cls in classes for f in dataclasses.fields(cls)} - _SKIP
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
