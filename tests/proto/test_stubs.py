"""The generated stubs are up to date and the wire enum matches the engine's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from modeserve.engine.forward_mode import ForwardMode
from modeserve.proto.v1 import forward_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_not_stale() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "proto" / "generate_stubs.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_wire_forward_mode_numbers_equal_python_enum() -> None:
    wire = {name.removeprefix("FORWARD_MODE_"): num for name, num in forward_pb2.ForwardMode.items()}
    assert wire.pop("UNSPECIFIED") == 0
    assert wire == {m.name: int(m) for m in ForwardMode}
