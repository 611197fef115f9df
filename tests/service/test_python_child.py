"""Children the service starts from a checkout do not see the checkout's top-level folders as packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from modeserve.engine.python_child import python_argv

ROOT = Path(__file__).resolve().parents[2]


def test_a_child_started_in_the_checkout_does_not_import_its_kernels_folder() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    probe = ("import importlib.util, json, sys; spec = importlib.util.find_spec('kernels'); "
             "print(json.dumps([sys.path, spec.origin if spec else None]))")
    path, origin = json.loads(subprocess.run(python_argv("-c", probe), cwd=ROOT, env=env, capture_output=True,
                                             text=True, check=True).stdout)
    assert str(ROOT) not in path and "" not in path
    assert origin is None or not origin.startswith(str(ROOT / "kernels"))
    # without -P the same child would find the checkout's folder: the probe can tell the difference
    bare = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True).stdout
    assert json.loads(bare)[1] == str(ROOT / "kernels" / "__init__.py")
