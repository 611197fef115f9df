"""The engine's warm-up (``warmup``, off by default): the steps it runs, that an engine warmed up
generates what a cold one does (greedy, as Hugging Face's), that the engine's own scheduler starts with
none of its steps and the whole KV pool, and that a pool too small for it skips it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from modeserve.engine import LLM, SamplingParams
from modeserve.engine.builder import build_engine
from modeserve.engine.config import EngineConfig
from modeserve.engine.warmup import warm_up
from tests.engine.tiny_models import load_reference, reference_greedy


def _modes(model: Path, **kwargs: object) -> dict[str, int]:
    parts = build_engine(str(model), warmup=False, **kwargs)
    return dict(warm_up(parts.runner, parts.config, parts.checkpoint.config))


def test_warm_up_prefills_in_chunks_decodes_and_runs_mixed_steps(tiny_llama: Path) -> None:
    """The second request's chunks run beside the first one's decodes (MIXED), over its cached prefix."""
    modes = _modes(tiny_llama, page_size=4, enable_mixed=True)
    assert modes["EXTEND"] == 1 and modes["EXTEND (cached prefix)"] == 2  # the first request's 93 tokens in 32s
    assert modes["MIXED"] == 4  # the second's 101, beside the first one's decodes
    assert modes["DECODE"] >= 1


def test_without_mixed_the_second_request_prefills_by_turns(tiny_llama: Path) -> None:
    modes = _modes(tiny_llama, page_size=16)
    assert modes["EXTEND"] == 2 and modes["EXTEND (cached prefix)"] == 5 and "MIXED" not in modes


def test_with_split_prefill_the_second_request_runs_slices(tiny_llama: Path) -> None:
    modes = _modes(tiny_llama, page_size=4, enable_split_prefill=True, split_prefill_token_budget=64)
    assert modes["SPLIT_PREFILL"] >= 2


def test_a_warmed_up_engine_generates_what_transformers_does(tiny_llama: Path) -> None:
    """Greedy outputs after the warm-up equal a loop of full forwards; the engine's scheduler counted none
    of the warm-up's steps and has its whole KV pool."""
    prompts = [[5, 9, 13, 2, 7], list(range(3, 60)), [11] * 20]
    ref = load_reference(tiny_llama)
    expected = [reference_greedy(ref, p, 6) for p in prompts]
    llm = LLM(model=str(tiny_llama), page_size=4, enable_mixed=True, warmup=True)
    assert llm.stats()["mode_distribution"] == {}
    assert llm.scheduler.kv.num_available_pages == llm.runner.num_pages - 1  # page 0: CUDA graphs' padding
    out = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_new_tokens=6,
                                                                                ignore_eos=True))
    assert [o.token_ids for o in out] == expected


def test_a_pool_too_small_skips_the_warm_up(tiny_llama: Path) -> None:
    assert _modes(tiny_llama, page_size=4, kv_cache_tokens=64) == {}


def test_warmup_is_off_by_default() -> None:
    assert EngineConfig.from_kwargs().runner.warmup is False
    assert EngineConfig.from_kwargs(warmup=True).runner.warmup is True


@pytest.mark.parametrize("page_size", [1, 16])
def test_warm_up_leaves_no_request_behind(tiny_llama: Path, page_size: int, caplog: pytest.LogCaptureFixture) -> None:
    """A warmed-up engine serves a prompt that needs the whole pool (all 16 pages at page size 16) at once,
    without preempting anything: the warm-up left none of its pages taken."""
    caplog.set_level(logging.INFO, logger="modeserve.engine.warmup")
    llm = LLM(model=str(tiny_llama), page_size=page_size, kv_cache_tokens=272, warmup=True)
    assert "warm-up ran" in caplog.text
    prompt = [int(t) for t in torch.randint(3, 200, (252,), generator=torch.Generator().manual_seed(0))]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0.0, max_new_tokens=4,
                                                                                 ignore_eos=True))
    assert len(out[0].token_ids) == 4 and llm.stats()["num_retractions"] == 0


@pytest.mark.gpu
def test_on_cuda_the_warm_up_runs_and_its_replays_do_not_count(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """On CUDA, an engine that warms up: its decode graphs' replay counts start at zero after it (they
    count the traffic's steps), and its fp32 greedy outputs equal transformers'."""
    from tests.engine.tiny_models import COMMON, make_tiny_model, mixed_prompts

    folder = make_tiny_model("llama3", tmp_path / "m")
    prompts = mixed_prompts(4, COMMON["vocab_size"], seed=3)
    ref = load_reference(folder)
    caplog.set_level(logging.INFO, logger="modeserve.engine.warmup")
    llm = LLM(model=str(folder), device="cuda", dtype="float32", page_size=16, enable_mixed=True,
              max_running_requests=8, warmup=True)
    assert "warm-up ran" in caplog.text and "MIXED" in caplog.text
    assert llm.runner.graphs is not None and llm.runner.graphs.stats()["hits"] == {}
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_new_tokens=6,
                                                                                 ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference_greedy(ref, p, 6) for p in prompts]
    assert llm.runner.graphs.stats()["hits"]["DECODE"] > 0
