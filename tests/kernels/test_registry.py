"""The typed factory registry: registration by decorator, creation by name, errors that list the names."""

from __future__ import annotations

import pytest

from modeserve.kernels.attention.base import ATTENTION_BACKENDS
from modeserve.kernels.registry import Registry


def test_register_create_and_names() -> None:
    shapes: Registry[[int], str] = Registry("shape")

    @shapes.register("square")
    def _square(n: int) -> str:
        return "#" * (n * n)

    @shapes.register("line")
    def _line(n: int) -> str:
        return "-" * n

    assert shapes.names() == ["line", "square"]
    assert "line" in shapes and "circle" not in shapes
    assert shapes.create("square", 2) == "####" and shapes.get("line")(3) == "---"
    with pytest.raises(ValueError, match=r"unknown shape 'circle'; available: \['line', 'square'\]"):
        shapes.create("circle", 1)
    with pytest.raises(ValueError, match="registered already"):
        shapes.register("line")(_line)


def test_attention_backends_are_registered() -> None:
    assert ATTENTION_BACKENDS.names() == ["flashinfer", "flashinfer-triton", "torch", "triton"]
