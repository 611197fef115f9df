"""The interpreter command line of every Python child process the engine and the service start."""

from __future__ import annotations

import sys


def python_argv(*args: str) -> list[str]:
    """``python -P ARGS``. ``-P`` keeps the working directory off ``sys.path``: started from a checkout,
    its top-level folders (``kernels/``, ``engine/``) would otherwise shadow installed distributions
    of the same name (transformers imports the ``kernels`` one)."""
    return [sys.executable, "-P", *args]
