"""``modeserve bench sampling``: through the real CLI on a GPU (the fused kernel draws the torch
reference's tokens, each figure next to its limit), and its refusal of a greedy setting."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from modeserve.service.bench.sampling import run
from modeserve.service.cli import build_parser


def test_greedy_temperature_is_refused() -> None:
    args = build_parser().parse_args(["bench", "sampling", "--temperature", "0"])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        run(args)


@pytest.mark.gpu
def test_bench_sampling_cli_reports_each_batch_against_its_limit() -> None:
    done = subprocess.run([sys.executable, "-m", "modeserve.service.cli", "bench", "sampling", "--batch-sizes", "1", "16",
                           "--vocab", "32000", "--top-k", "200", "--repeats", "5"],
                          capture_output=True, text=True, timeout=600, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["bench"] == "sampling" and out["vocab"] == 32000 and out["measured_copy_bandwidth_tb_s"] > 0.1
    assert [row["batch_size"] for row in out["by_batch_size"]] == [1, 16]
    for row in out["by_batch_size"]:
        assert row["same_tokens"] is True
        assert row["batch_size"] <= row["kept_ranks"] <= 200 * row["batch_size"]  # top-k 200, then top-p 0.95
        assert row["after_sort_bytes"] == row["batch_size"] * 32000 * 4 + row["kept_ranks"] * 8  # logits, kept ids
        for name in ("torch", "fused"):
            fig = row[name]
            assert fig["sample_us"] > 0 and fig["after_sort_us"] > 0
            assert fig["after_sort_roofline_ratio"] == pytest.approx(
                row["after_sort_roofline_us"] / fig["after_sort_us"], rel=0.02, abs=0.002)
        assert row["after_sort_speedup"] == pytest.approx(
            row["torch"]["after_sort_us"] / row["fused"]["after_sort_us"], rel=0.02)
