"""Every function of the packages is typed and mypy agrees with the types (pyproject's [tool.mypy]:
untyped defs are errors, except Triton's JIT kernels, whose parameters Triton types itself)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_mypy_finds_nothing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
                           "engine", "kernels", "service", "operator"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_only_triton_kernels_go_untyped() -> None:
    """The override above exempts whole modules: their functions that are not ``@triton.jit``
    kernels must still be annotated."""
    untyped = []
    for path in sorted((ROOT / "kernels" / "triton").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if any("jit" in ast.unparse(d) for d in node.decorator_list):
                continue
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if node.returns is None or any(a.annotation is None for a in args if a.arg not in ("self", "cls")):
                untyped.append(f"{path.name}:{node.lineno} {node.name}")
    assert not untyped, untyped
