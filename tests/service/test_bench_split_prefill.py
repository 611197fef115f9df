"""``modeserve bench split-prefill`` on a tiny random model (4 layers, 3 decoders, prompts of 96 and 160
tokens): a JSON line per (prompt, setting) and a summary per prompt; each setting ran the steps it names
in the long prompt's window (SPLIT_PREFILL slices only in the split settings, as many as the budget
gives), the long prompt's first token is the same under every setting, every ratio is its figure over
its reference."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from modeserve.engine.models.random_checkpoint import preset_config

LENS = (96, 160)
LABELS = ["no-chunking", "chunked-32", "mixed-0.3", "mixed-0.9", "split-96", "split-200"]
# layers a slice: max(1, budget // prompt tokens) of 4 -> SPLIT_PREFILL steps
SLICES = {("split-96", 96): 4, ("split-96", 160): 4, ("split-200", 96): 2, ("split-200", 160): 4}


@pytest.fixture(scope="module")
def lines(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    shape = tmp_path_factory.mktemp("shape") / "config.json"
    shape.write_text(json.dumps({**preset_config("tiny"), "num_hidden_layers": 4}))
    # one thread: on a busy 2-core machine a second one spins and the run takes several times as long
    done = subprocess.run([sys.executable, "-m", "modeserve.service.cli", "bench", "split-prefill", "--shape", str(shape),
                           "--num-decoders", "3", "--decoder-prompt-len", "16", "--prompt-lens", *map(str, LENS),
                           "--chunk-sizes", "32", "--split-budgets", "96", "200", "--warmup-steps", "2",
                           "--steady-steps", "4", "--solo-repeats", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_one_line_per_prompt_and_setting_then_a_summary_per_prompt(lines: list[dict]) -> None:
    rows, summaries = [r for r in lines if not r.get("summary")], [r for r in lines if r.get("summary")]
    assert [(r["setting"], r["prompt_len"]) for r in rows] == [(s, n) for s in LABELS for n in LENS]
    assert [s["prompt_len"] for s in summaries] == list(LENS) and lines[-2:] == summaries
    for s in summaries:
        mine = [r for r in rows if r["prompt_len"] == s["prompt_len"]]
        assert s["meeting_goal"] == [r["setting"] for r in mine if r["meets_goal"]]
        assert s["split_prefill_meets_goal"] == any(r["meets_goal"] for r in mine if r["mode"] == "split_prefill")
        assert s["nearest_split"]["setting"] in ("split-96", "split-200")


def test_each_setting_ran_its_own_steps_in_the_window(lines: list[dict]) -> None:
    for r in (r for r in lines if not r.get("summary")):
        steps, n = r["window_steps"], r["prompt_len"]
        if r["mode"] == "split_prefill":
            assert steps["SPLIT_PREFILL"] == SLICES[(r["setting"], n)] and "EXTEND" not in steps
            assert steps["DECODE"] >= steps["SPLIT_PREFILL"] - 1  # by turns with the decode steps
        else:
            assert "SPLIT_PREFILL" not in steps
        if r["mode"] == "no_chunking":
            assert steps["EXTEND"] == 1
        if r["mode"] == "chunked":  # prefill steps come first: the chunks back to back
            assert steps["EXTEND"] == math.ceil(n / 32)
        if r["mode"] == "mixed":
            assert steps["MIXED"] >= 1 and "EXTEND" not in steps
        assert r["num_gaps"] >= r["num_decoders"]  # every decoder has a gap across the window


def test_the_long_prompt_gives_one_first_token_under_every_setting(lines: list[dict]) -> None:
    for n in LENS:
        rows = [r for r in lines if r["prompt_len"] == n and not r.get("summary")]
        assert len({r["first_token"] for r in rows}) == 1 and all(r["first_token_matches_solo"] for r in rows)


def test_every_ratio_is_its_figure_over_its_reference(lines: list[dict]) -> None:
    for r in (r for r in lines if not r.get("summary")):
        assert 0 < r["steady_itl_ms"] and 0 < r["itl_p50_ms"] <= r["itl_p90_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"]
        assert r["itl_p90_vs_steady"] == pytest.approx(r["itl_p90_ms"] / r["steady_itl_ms"], rel=0.01)
        assert r["itl_p99_vs_steady"] == pytest.approx(r["itl_p99_ms"] / r["steady_itl_ms"], rel=0.01)
        assert r["itl_p50_vs_steady"] == pytest.approx(r["itl_p50_ms"] / r["steady_itl_ms"], rel=0.01)
        assert r["ttft_vs_solo"] == pytest.approx(r["ttft_ms"] / r["solo_prefill_ms"], rel=0.01)
        at_edge = abs(r["itl_p99_vs_steady"] - 1.5) < 0.01 or abs(r["ttft_vs_solo"] - 1.25) < 0.01  # rounding
        assert at_edge or r["meets_goal"] == (r["itl_p99_vs_steady"] <= 1.5 and r["ttft_vs_solo"] <= 1.25)


def test_trace_dir_records_each_window(tmp_path: Path) -> None:
    """``--trace-dir``: each row names a gzipped Chrome trace of its window, whose host ops span at least
    the long prompt's TTFT (the window it recorded)."""
    shape = tmp_path / "config.json"
    shape.write_text(json.dumps({**preset_config("tiny"), "num_hidden_layers": 4}))
    done = subprocess.run([sys.executable, "-m", "modeserve.service.cli", "bench", "split-prefill", "--shape", str(shape),
                           "--num-decoders", "2", "--decoder-prompt-len", "16", "--prompt-lens", "96",
                           "--chunk-sizes", "32", "--split-budgets", "96", "--mixed-prefill-ratios", "0.9",
                           "--warmup-steps", "2", "--steady-steps", "2", "--solo-repeats", "1", "--threads", "1",
                           "--trace-dir", str(tmp_path / "traces")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in map(json.loads, done.stdout.splitlines()) if not r.get("summary")]
    assert [r["setting"] for r in rows] == ["no-chunking", "chunked-32", "mixed-0.9", "split-96"]
    for r in rows:
        assert r["trace"] == str(tmp_path / "traces" / f"{r['setting']}-96.json.gz")
        with gzip.open(r["trace"], "rt") as f:
            ops = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "cpu_op"]
        assert any(e["name"].startswith("aten::") for e in ops)
        span_ms = (max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)) / 1e3
        assert span_ms >= r["ttft_ms"]


def test_settings_lists_given_empty_leave_those_settings_out() -> None:
    """``--chunk-sizes`` and ``--mixed-prefill-ratios`` with no value: no chunked or MIXED setting (not the
    defaults); the overlap settings cross decode steps, SM counts and decode GEMMs."""
    import argparse

    from modeserve.service.bench import split_prefill_settings as split_prefill

    p = argparse.ArgumentParser()
    split_prefill.add_arguments(p)
    args = p.parse_args(["--device", "cuda", "--prompt-lens", "64", "--chunk-sizes", "--mixed-prefill-ratios",
                         "--split-budgets", "64", "--overlap-decode-steps", "1", "--overlap-sms", "0", "108",
                         "--overlap-gemms", "triton", "cublas", "--overlap-confine", "off", "on"])
    assert args.chunk_sizes == [] and args.mixed_prefill_ratios == []
    got = {s.label: s.params for s in split_prefill.settings(args, args.chunk_sizes, args.split_budgets, 32)}
    assert list(got) == ["no-chunking", "split-64", "split-64-overlap-tgemm", "split-64-overlap",
                         "split-64-overlap-sm108-tgemm", "split-64-overlap-sm108", "split-64-overlap-sm108-conf-tgemm",
                         "split-64-overlap-sm108-conf"]  # confined decodes need the SMs split: none at sm0
    assert got["split-64-overlap-sm108-tgemm"]["small_batch_gemm"] == "triton"
    assert "small_batch_gemm" not in got["split-64-overlap-sm108"]
    assert got["split-64-overlap-sm108-conf"]["split_prefill_confine_decodes"] is True
    assert "split_prefill_confine_decodes" not in got["split-64-overlap-sm108"]
    assert got["split-64-overlap-sm108"]["split_prefill_overlap_sms"] == 108


def test_one_prompt_length_among_many_decoders_fits_the_kv_pool(tmp_path: Path) -> None:
    """With one prompt length the decoders' KV growth leaves no margin from a second window: the pool must
    still hold the page per decoder that the scheduler keeps free before it admits a prefill beside them
    (else the prompt waits until the decoders finish: no window)."""
    shape = tmp_path / "config.json"
    shape.write_text(json.dumps({**preset_config("tiny"), "num_hidden_layers": 2}))
    done = subprocess.run([sys.executable, "-m", "modeserve.service.cli", "bench", "split-prefill", "--shape", str(shape),
                           "--num-decoders", "16", "--decoder-prompt-len", "16", "--prompt-lens", "256",
                           "--chunk-sizes", "--mixed-prefill-ratios", "--split-budgets", "--warmup-steps", "2",
                           "--steady-steps", "2", "--solo-repeats", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in map(json.loads, done.stdout.splitlines()) if not r.get("summary")]
    assert [(r["setting"], r["prompt_len"], r["window_steps"]["EXTEND"]) for r in rows] == [("no-chunking", 256, 1)]


def test_warm_windows_are_counted_and_never_negative() -> None:
    """Each row says how many unmeasured windows its setting ran first; a negative count is refused before
    any engine is built."""
    import argparse

    from modeserve.service.bench import split_prefill, split_prefill_settings

    p = argparse.ArgumentParser()
    split_prefill_settings.add_arguments(p)
    assert p.parse_args([]).warm_windows == 1
    with pytest.raises(ValueError, match="--warm-windows must be >= 0"):
        next(split_prefill.run(p.parse_args(["--warm-windows", "-1"])))


def test_rows_name_their_warm_windows(lines: list[dict]) -> None:
    """Every row says how many unmeasured windows its engines ran first."""
    assert {r["warm_windows"] for r in lines} == {1}
