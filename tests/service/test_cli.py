"""The ``modeserve`` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest



def modeserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "modeserve.service.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_streams_answer_from_default_model() -> None:
    proc = modeserve("generate", "What is the capital of France?", "--max-new-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_bad_input_is_a_clear_error() -> None:
    proc = modeserve("generate", "hi", "--model", "/nonexistent/model")
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_offline_prints_json_with_peer_ratio(tmp_path: Path) -> None:
    proc = modeserve("bench", "offline", "--num-prompts", "3", "--new-tokens", "4", "--max-prompt-tokens", "40",
                     "--min-prompt-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["modeserve"]["output_tokens"] == result["transformers"]["output_tokens"] == 12
    expected = result["modeserve"]["output_tokens_per_s"] / result["transformers"]["output_tokens_per_s"]
    assert result["speedup_vs_transformers"] == pytest.approx(expected, rel=1e-2)


def test_bench_serving_prints_json_with_ratios() -> None:
    proc = modeserve("bench", "serving", "--batch-sizes", "1,2", "--steps", "32", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["transport"], r["overlap"], r["batch_size"]) for r in result["results"]} == {
        (t, o, b) for t in ("inprocess", "grpc") for o in (False, True) for b in (1, 2)}
    assert all(r["us_per_decode_step"] > 0 for r in result["results"])
    assert set(result["ratios"]) == {"bs1", "bs2"}
