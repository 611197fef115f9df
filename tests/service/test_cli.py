"""The ``modeserve`` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from modeserve.engine.python_child import python_argv


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


def test_bad_sampling_values_are_refused_before_the_model_loads() -> None:
    proc = modeserve("generate", "hi", "--top-p", "1.5", "--model", "/nonexistent/model")
    assert proc.returncode == 2
    assert "top_p must be in (0, 1], got 1.5" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_offline_prints_json_with_peer_ratio(tmp_path: Path) -> None:
    proc = modeserve("bench", "offline", "--num-prompts", "3", "--new-tokens", "4", "--max-prompt-tokens", "40",
                     "--min-prompt-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["modeserve"]["output_tokens"] == result["transformers"]["output_tokens"] == 12
    expected = result["modeserve"]["output_tokens_per_s"] / result["transformers"]["output_tokens_per_s"]
    assert result["speedup_vs_transformers"] == pytest.approx(expected, rel=1e-2)


def test_bench_dp_prints_scaling_json() -> None:
    proc = modeserve("bench", "dp", "--engines", "1,2", "--num-prompts", "8", "--new-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["output_tokens_per_s"]) == {"1", "2"} and all(v > 0 for v in result["output_tokens_per_s"].values())
    assert result["scaling_vs_1"]["1"] == 1.0 and result["ideal_scaling"]["2"] == min(2, result["cpu_cores"])


def test_gpu_benches_run_on_cpu_with_limits_and_baseline() -> None:
    """``bench latency`` / ``bench throughput`` on a tiny shape on CPU: every figure comes with its
    measured limit and the transformers peer (the H200 figures come from .ci/gpu-bench)."""
    lat = modeserve("bench", "latency", "--shape", "tiny", "--device", "cpu", "--input-len", "16", "--output-len", "6",
                    "--baseline", "transformers", "--baseline-output-len", "4", "--profile-steps", "3")
    assert lat.returncode == 0, lat.stderr
    r = json.loads(lat.stdout.strip().splitlines()[-1])
    assert 0 < r["decode_roofline_ratio"] and 0 < r["prefill_matmul_ratio"] and r["measured_copy_bandwidth_tb_s"] > 0
    assert r["transformers"]["decode_step_ms"] > 0 and r["decode_speedup_vs_transformers"] > 0
    names = [k["name"] for k in r["decode_profile"]["top_kernels"]]
    assert any("linear" in n or "addmm" in n or "mm" in n for n in names), names
    pre = r["prefill_profile"]
    assert pre["steps"] == 1 and pre["wall_ms"] > 0 and pre["device_ms"] is None  # CPU: no device timeline
    assert any("linear" in k["name"] or "mm" in k["name"] for k in pre["top_kernels"]), pre["top_kernels"]
    assert pre["top_host_ops"] and all(k["us_per_step"] > 0 for k in pre["top_host_ops"])
    assert sum(k["us_per_step"] for k in pre["top_host_ops"]) <= pre["host_op_ms"] * 1e3 + 1
    thr = modeserve("bench", "throughput", "--shape", "tiny", "--device", "cpu", "--num-prompts", "6", "--input-len",
                    "16", "--output-len", "5", "--max-running-requests", "4")
    assert thr.returncode == 0, thr.stderr
    t = json.loads(thr.stdout.strip().splitlines()[-1])
    assert t["output_tokens_per_s"] > 0 and 0 < t["roofline_ratio"] and t["steps_by_mode"]["DECODE"] >= 4


def test_gpu_bench_shape_from_a_config_json(tmp_path: Path) -> None:
    """``--shape`` also takes a Hugging Face config.json: its layers and widths are what the roofline
    counts (the tiny preset with twice the layers reads about twice the weights a step); a file that is
    not a JSON object is a clear error."""
    from modeserve.engine.models.random_checkpoint import PRESETS

    def step_bytes(shape: str) -> int:
        proc = modeserve("bench", "latency", "--shape", shape, "--device", "cpu", "--input-len", "8",
                         "--output-len", "3")
        assert proc.returncode == 0, proc.stderr
        return int(json.loads(proc.stdout.strip().splitlines()[-1])["decode_step_bytes"])

    config = dict(PRESETS["tiny"], num_hidden_layers=2 * PRESETS["tiny"]["num_hidden_layers"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    tiny, deeper = step_bytes("tiny"), step_bytes(str(tmp_path / "config.json"))
    assert 1.5 * tiny < deeper < 2.1 * tiny
    (tmp_path / "bad.json").write_text("[1, 2]")
    bad = modeserve("bench", "latency", "--shape", str(tmp_path / "bad.json"), "--device", "cpu")
    assert bad.returncode == 2 and "one JSON object" in bad.stderr


def test_bench_tracing_prints_overhead_json() -> None:
    proc = modeserve("bench", "tracing", "--steps", "16", "--repeats", "1", "--batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["us_per_decode_step"]["tracing_off"] > 0 and r["us_per_decode_step"]["tracing_on"] > 0
    assert r["spans_received"] == r["spans_created"] > 16  # the spans really reached the OTLP receiver
    assert r["flush_ms_per_run"] > 0
    assert set(r["gc_collections"]) == set(r["gc_ms"]) == {"tracing_off", "tracing_off_again", "tracing_on"}
    assert set(r["loop_us_per_decode_step"]) == set(r["gc_ms"]) and min(r["loop_us_per_decode_step"].values()) > 0
    rounds = [line for line in proc.stderr.splitlines() if line.startswith("bench tracing round")]
    assert len(rounds) == 3 * 2  # the warm-up round and one measured, three runs each, as they ended
    dropped = modeserve("bench", "tracing", "--steps", "16", "--repeats", "1", "--batch-size", "2", "--exporter", "none")
    assert dropped.returncode == 0, dropped.stderr
    d = json.loads(dropped.stdout.strip().splitlines()[-1])
    assert d["exporter"] == "none" and d["spans_received"] == d["spans_created"] > 16


def test_the_command_builds_without_the_http_stack() -> None:
    """The GPU machine has no FastAPI or uvicorn: ``modeserve bench`` (and a router without --http-port)
    must not import them; a child where both imports fail still parses every sub-command."""
    probe = ("import sys; sys.modules['fastapi'] = sys.modules['uvicorn'] = None\n"
             "from modeserve.service.cli import build_parser\n"
             "build_parser().parse_args(['bench', 'verify', '--shape', 'tiny']); print('ok')")
    done = subprocess.run(python_argv("-c", probe), capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
