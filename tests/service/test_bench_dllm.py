"""``modeserve bench dllm`` on the tiny shape (block sizes 4 and 8, batch 1 and 3, a 10-token prompt, so the
first block holds prompt tokens): a JSON line per (block, batch); the timed steps are the DLLM_EXTEND steps
of the blocks after the first (one a token: random weights commit one token a step, each block's first step
carrying the block before it) and as many DECODE steps; every ratio and tok/s is its figure over its
reference; the SDAR preset is the Qwen3 one with a block."""

from __future__ import annotations

import subprocess
import sys

import pytest

from modeserve.engine.models.model_config import parse_model_config
from modeserve.engine.models.random_checkpoint import PRESETS, preset_config
from modeserve.service.bench.dllm import autoregressive_config, committed_levels, first_block_outputs

BLOCKS, BATCHES, PROMPT_LEN, TIMED_BLOCKS = (4, 8), (1, 3), 10, 2


@pytest.fixture(scope="module")
def lines() -> list[dict]:
    import json

    # one thread: on a busy 2-core machine a second one spins and the run takes several times as long
    done = subprocess.run([sys.executable, "-m", "modeserve.service.cli", "bench", "dllm", "--shape", "tiny",
                           "--block-sizes", *map(str, BLOCKS), "--batch-sizes", *map(str, BATCHES),
                           "--prompt-len", str(PROMPT_LEN), "--blocks", str(TIMED_BLOCKS), "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_one_line_per_block_and_batch_size(lines: list[dict]) -> None:
    assert [(r["block_size"], r["batch_size"]) for r in lines] == [(k, b) for k in BLOCKS for b in BATCHES]
    assert {(r["bench"], r["device"], r["dtype"], r["attention_backend"]) for r in lines} == {
        ("dllm", "cpu", "float32", "torch")}


def test_the_timed_steps_are_the_later_blocks_denoised_a_token_a_step(lines: list[dict]) -> None:
    for r in lines:
        k, b = r["block_size"], r["batch_size"]
        assert r["steady_steps_by_mode"] == {"DLLM_EXTEND": TIMED_BLOCKS * k} and r["dllm_steps"] == TIMED_BLOCKS * k
        assert r["decode_steady_steps_by_mode"] == {"DECODE": TIMED_BLOCKS * k}
        # a block's first step also carries the committed block before it
        by = r["dllm_step_ms_by_tokens"]
        assert {n: v["steps"] for n, v in by.items()} == {str(b * k): TIMED_BLOCKS * (k - 1), str(2 * b * k): TIMED_BLOCKS}
        assert min(v["ms"] for v in by.values()) > 0
        # every step of the run (the first block's too) unmasked one token of each request's block
        new = first_block_outputs(PROMPT_LEN, k) + TIMED_BLOCKS * k
        assert r["dllm_unmasked_per_step"] == {"1": b * new} and r["mean_committed_per_step"] == 1.0


def test_every_ratio_and_rate_is_its_figure_over_its_reference(lines: list[dict]) -> None:
    for r in lines:
        k, b = r["block_size"], r["batch_size"]
        step, decode = r["dllm_step_ms"], r["decode_step_ms"]
        assert step > 0 and decode > 0
        assert r["dllm_vs_decode"] == pytest.approx(step / decode, rel=0.01)
        assert r["decode_tok_s"] == pytest.approx(b * 1e3 / decode, rel=0.01)
        flat, cycle = r["tok_s_at_committed"], r["tok_s_at_committed_with_commit_steps"]
        assert list(flat) == list(cycle) == [str(c) for c in committed_levels(k)]
        for c in committed_levels(k):
            assert flat[str(c)] == pytest.approx(b * c * 1e3 / step, rel=0.01)
            assert flat[str(c)] == pytest.approx(c * flat["1"], rel=0.01)
            assert r["tok_s_at_committed_vs_decode"][str(c)] == pytest.approx(flat[str(c)] / r["decode_tok_s"], rel=0.01)
            assert r["tok_s_at_committed_with_commit_steps_vs_decode"][str(c)] == pytest.approx(
                cycle[str(c)] / r["decode_tok_s"], rel=0.01)
        by = r["dllm_step_ms_by_tokens"]
        in_block, first = by[str(b * k)]["ms"], by[str(2 * b * k)]["ms"]
        assert cycle["1"] == pytest.approx(b * k * 1e3 / (first + (k - 1) * in_block), rel=0.01)
        assert cycle[str(k)] == pytest.approx(b * k * 1e3 / first, rel=0.01)  # a block a step: each carries the last


def test_levels_and_the_sdar_preset() -> None:
    assert committed_levels(4) == [1, 2, 4] and committed_levels(6) == [1, 2, 4, 6] and committed_levels(1) == [1]
    assert first_block_outputs(8, 4) == 4 and first_block_outputs(10, 4) == 2
    sdar = preset_config("sdar-1.7b")
    assert autoregressive_config(sdar) == PRESETS["qwen3-1.7b"]
    mc = parse_model_config(sdar)
    assert (mc.is_dllm, mc.dllm_block_size, mc.dllm_mask_token_id, mc.num_layers) == (True, 4, 151669, 28)
