"""Every function of the packages is typed and mypy agrees with the types (pyproject's [tool.mypy]:
untyped defs are errors, except Triton's JIT kernels, whose parameters Triton types itself)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def package_tree(dest: Path) -> Path:
    """The installed layout of the package (``modeserve/`` holding each top-level folder under its
    subpackage name, as pyproject's package-dir maps them), linked into ``dest``."""
    pkg = dest / "modeserve"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").symlink_to(ROOT / "src" / "modeserve" / "__init__.py")
    for folder in ("engine", "kernels", "service", "operator", "proto"):
        (pkg / folder).symlink_to(ROOT / folder, target_is_directory=True)
    return dest


@pytest.mark.slow
def test_mypy_checks_the_package_as_imported(tmp_path: Path) -> None:
    """``mypy -p modeserve`` over that layout: every ``modeserve.*`` import resolves (only third-party
    modules may be missing), and it reports nothing."""
    tree = package_tree(tmp_path / "tree")
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(tmp_path / "cache"), "-p", "modeserve"],
                          cwd=tree, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


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
