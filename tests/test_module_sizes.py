"""The layout's size rules: no file in ``service/`` over 300 lines, no other source file over 400 (the
generated protobuf stubs aside): a module past them is split by job."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi", "_pb2_grpc.pyi")


def _over_limit() -> list[str]:
    over = []
    for top in ("engine", "kernels", "service", "operator", "proto", "src", "tests"):
        limit = 300 if top == "service" else 400
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name.endswith(GENERATED):
                continue
            with path.open(encoding="utf-8") as f:
                lines = sum(1 for _ in f)
            if lines > limit:
                over.append(f"{path.relative_to(ROOT)}: {lines} lines > {limit}")
    return over


def test_every_source_file_is_within_its_size_limit() -> None:
    assert _over_limit() == []
