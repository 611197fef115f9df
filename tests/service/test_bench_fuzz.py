"""``modeserve bench fuzz`` with tiny numbers: real engine and router processes, one JSON line, every case
served or refused, no crash, the streams alongside and after exact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
KINDS = {"generate", "http", "grpc_frames_router", "grpc_messages_router", "grpc_frames_engine",
         "grpc_messages_engine", "forward_random", "forward_mutated"}
MAX_CASES = 12


def test_bench_fuzz_reports_every_kind_served_or_refused() -> None:
    out = subprocess.run([sys.executable, "-m", "modeserve.service.cli", "bench", "fuzz", "--seconds", "4",
                          "--cases", str(MAX_CASES), "--witness-tokens", "16", "--seed", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    report = json.loads(lines[0])
    assert report["bench"] == "fuzz" and report["seed"] == 3
    assert set(report["kinds"]) == KINDS
    for name, kind in report["kinds"].items():
        assert 0 < kind["tried"] <= MAX_CASES, (name, kind)
        assert kind["ok"] + kind["refused"] + kind["other"] == kind["tried"] == sum(kind["statuses"].values()), name
        assert kind["other"] == 0, (name, kind["other_examples"])
    assert report["cases"] == sum(k["tried"] for k in report["kinds"].values())
    assert report["other"] == 0 and report["crashes"] == 0
    assert report["router"]["alongside_exact"] and report["router"]["alongside_runs"] >= 1
    assert report["router"]["router_idle_after"]
    assert report["engine"]["alongside_exact"] and report["engine"]["exact_after_forward"]
    for name in ("engine", "router"):
        proc = report["processes"][name]
        assert proc["alive"] and proc["rss_start_mib"] > 0, (name, proc)
        assert proc["rss_growth_mib"] == pytest.approx(proc["rss_end_mib"] - proc["rss_start_mib"], abs=0.2)
