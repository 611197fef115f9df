"""A typed registry of named factories: ``@REGISTRY.register(name)`` on a function that builds the
object (importing its implementation inside, so only the chosen one is imported), ``create(name, ...)``
to build one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class Registry(Generic[P, T]):
    """Name -> factory taking ``P`` and returning ``T``. ``kind`` names what it holds in errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[P, T]] = {}

    def register(self, name: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """Decorator: register the decorated factory under ``name`` (a name is registered once)."""

        def add(factory: Callable[P, T]) -> Callable[P, T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is registered already")
            self._factories[name] = factory
            return factory

        return add

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def check(self, name: str) -> None:
        """``ValueError`` listing the registered names unless ``name`` is one."""
        if name not in self._factories:
            raise ValueError(f"unknown {self.kind} {name!r}; available: {self.names()}")

    def get(self, name: str) -> Callable[P, T]:
        self.check(name)
        return self._factories[name]

    def create(self, name: str, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.get(name)(*args, **kwargs)
