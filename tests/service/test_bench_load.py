"""``modeserve bench serving`` and ``bench streams`` at tiny sizes on CPU: the JSON they print has
its keys, and its counts add up to the requests sent."""

from __future__ import annotations

import json

import pytest

from tests.service.test_cli import modeserve


def test_bench_serving_reports_each_target_api_and_concurrency_next_to_offline() -> None:
    n, out_len = 6, 5
    proc = modeserve("bench", "serving", "--num-prompts", str(n), "--input-len", "8", "--output-len", str(out_len),
                     "--concurrency", "1,4", "--waves", "8", "--processes", "2", "--api", "both")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bench"] == "serving" and r["engine_args"]["max_running_requests"] == 4
    assert r["offline"]["output_tokens"] == n * out_len and r["offline"]["decode_step_ms_batch1"] > 0
    assert [(row["target"], row["concurrency"], row["api"]) for row in r["results"]] == [
        (t, c, a) for t in ("serve", "router") for c in (1, 4) for a in ("grpc", "http")]
    for row in r["results"]:
        assert row["completed"] == n and row["failed"] == 0 and row["status_codes"] == {"OK": n}
        tokens = row["output_tokens_per_s"] * row["seconds"]
        assert tokens == pytest.approx(n * out_len, rel=0.02)  # the rate is the tokens over the wall time
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"] and 0 < row["itl_ms_p50"] <= row["itl_ms_p99"]
        ratio = row["output_tokens_per_s"] / r["offline"]["output_tokens_per_s"]
        assert row["vs_offline_output_tok_s"] == pytest.approx(ratio, abs=2e-3)
    assert set(r["serving_vs_offline_at_max_concurrency"]) == {"serve", "router"}
    assert set(r["itl_p50_vs_decode_step_at_concurrency_1"]) == {f"{t}/{a}" for t in ("serve", "router")
                                                                  for a in ("grpc", "http")}
    by = {(row["target"], row["api"], row["concurrency"]): row["output_tokens_per_s"] for row in r["results"]}
    assert r["http_vs_grpc_output_tok_s"] == {
        f"{t}/c{c}": pytest.approx(by[t, "http", c] / by[t, "grpc", c], abs=2e-3) for t in ("serve", "router") for c in (1, 4)}


def test_bench_streams_counts_add_up_with_refusals() -> None:
    n, limit = 300, 100
    proc = modeserve("bench", "streams", "--streams", str(n), "--max-queued-requests", str(limit),
                     "--max-new-tokens", "8", "--processes", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bench"] == "streams" and r["streams"] == n and r["max_queued_requests"] == limit
    parts = r["completed"] + r["short"] + r["refused"] + r["cancelled"] + sum(r["other_errors"].values())
    assert parts == sum(r["status_codes"].values()) == n
    assert r["completed"] >= limit and r["refused"] > 0 and r["short"] == 0, r
    assert r["seconds"] > 0 and r["client_processes"] == 2
