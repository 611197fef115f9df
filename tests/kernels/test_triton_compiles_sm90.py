"""Every Triton kernel compiles for Hopper, checked on CPU (no GPU needed): see ``sm90_compile.py``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")


def _run(*extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *extra], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_every_triton_kernel_compiles_for_sm90() -> None:
    done = _run()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "FAIL" not in done.stdout
    names = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("ok ")}
    assert {"_gemv_kernel", "_decode_split_kernel", "_extend_kernel", "_rotary_kernel", "_record_tokens_kernel",
            "_row_argmax_kernel", "_add_rms_norm_kernel", "_silu_and_mul_kernel", "_chunk_mass_kernel", "_chunk_draw_kernel",
            "_row_pick_kernel", "_chain_verify_kernel", "_accept_kernel", "_small_gemm_kernel"} <= names


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_a_kernel_the_interpreter_runs_but_the_compiler_refuses_fails() -> None:
    """The check is not vacuous: a kernel that runs in the interpreter (a variable given another block
    shape inside an ``if``) is reported and fails the run."""
    done = _run("--self-check")
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    assert "FAIL _reshaped_in_branch" in done.stdout
