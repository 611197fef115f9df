"""``modeserve bench speculative`` on the default model (real SmolLM2 weights): its JSON line, the
n-gram outputs equal to plain greedy ones, and drafts accepted on a passage-copying prompt."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_speculative_reports_equal_outputs_and_accepted_drafts() -> None:
    done = subprocess.run([sys.executable, "-m", "modeserve.service.cli", "bench", "speculative", "--batch-sizes", "1",
                           "--new-tokens", "12"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    (row,) = line["results"]
    assert line["bench"] == "speculative" and row["outputs_equal"] is True and row["output_tokens"] == 12
    assert row["accepted_tokens"] > 0 and row["acceptance_length"] > 1.0
    assert row["plain_tok_s"] > 0 and row["ngram_tok_s"] > 0


def test_bench_verify_times_verify_steps_of_exactly_k_drafts() -> None:
    done = subprocess.run([sys.executable, "-m", "modeserve.service.cli", "bench", "verify", "--shape", "tiny",
                           "--device", "cpu", "--batch-sizes", "1", "3", "--ks", "1", "4", "--input-len", "40",
                           "--output-len", "6"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["bench"] == "verify" and [r["batch_size"] for r in line["results"]] == [1, 3]
    for row in line["results"]:
        assert row["drafts_per_request_step"] == {"1": 1.0, "4": 4.0}  # every verify step carried k drafts
        assert row["decode_step_ms"] > 0 and all(v > 0 for v in row["verify_step_ms"].values())
        assert set(row["projected_speedup_at_acceptance_3"]) == {"4"}  # one draft cannot make 3 tokens
        # the host's time a step by phase: on CPU the device is the host, so the phases make up the step
        host = row["host_us_per_step"]
        for phases, ms in [(host["decode"], row["decode_step_ms"]), *((host["verify"][k], row["verify_step_ms"][k])
                                                                      for k in ("1", "4"))]:
            assert set(phases) == {"schedule", "launch", "wait", "process"} and min(phases.values()) >= 0
            assert phases["launch"] > 0 and 0.5 * ms * 1e3 < sum(phases.values()) <= 1.05 * ms * 1e3
