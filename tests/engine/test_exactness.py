"""Greedy tokens and logits of ``LLM`` equal the ``transformers`` reference, under every scheduling
feature: chunked prefill, MIXED steps, page sizes 1 and 16, prefix-cache hits, preemption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from modeserve.engine import LLM, SamplingParams
from modeserve.engine.forward_batch import ForwardResult
from tests.engine.tiny_models import ARCHS, COMMON, load_reference, make_tiny_model, mixed_prompts, reference_greedy, reference_logits

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)

# scenario -> (LLM kwargs, prompt kwargs, stat that must show the feature was exercised)
SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any], str | None]] = {
    "plain": (dict(page_size=16), {}, None),
    "chunked": (dict(page_size=16, chunked_prefill_size=7), {}, None),
    "mixed": (dict(page_size=16, chunked_prefill_size=16, enable_mixed=True, max_prefill_ratio=0.9), {}, "MIXED"),
    "page1": (dict(page_size=1, chunked_prefill_size=5), {}, None),
    "prefix_cache": (dict(page_size=4, enable_prefix_cache=True, chunked_prefill_size=32),
                     dict(shared_prefix=24), "prefix_hits"),
    "preemption": (dict(page_size=4, kv_cache_tokens=128, chunked_prefill_size=64), dict(max_len=40), "retractions"),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param),
                             max_shard_size="100KB" if request.param == "qwen3" else None)
    return request.param, folder, load_reference(folder)


def _check_feature(llm: LLM, feature: str | None) -> None:
    stats = llm.stats()
    if feature == "MIXED":
        assert stats["mode_distribution"].get("MIXED", 0) > 0, stats
    elif feature == "prefix_hits":
        assert stats["num_prefix_hit_tokens"] > 0, stats
    elif feature == "retractions":
        assert stats["num_retractions"] > 0, stats


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_tokens_match_transformers(arch: tuple[str, Path, Any], scenario: str) -> None:
    name, folder, ref = arch
    llm_kwargs, prompt_kwargs, feature = SCENARIOS[scenario]
    prompts = mixed_prompts(8, COMMON["vocab_size"], seed=1, **prompt_kwargs)
    llm = LLM(model=str(folder), device="cpu", dtype="float32", **llm_kwargs)
    if scenario == "prefix_cache":  # warm the cache with one request, then the batch hits it
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "length"
        assert out.token_ids == reference_greedy(ref, prompt, MAX_NEW), (name, scenario, len(prompt))
    _check_feature(llm, feature)


@pytest.mark.parametrize("scenario", ["mixed", "prefix_cache", "preemption"])
def test_logits_match_transformers_every_step(arch: tuple[str, Path, Any], scenario: str) -> None:
    """Drive scheduler and runner by hand; every sampled row's logits equal a full HF forward."""
    name, folder, ref = arch
    llm_kwargs, prompt_kwargs, feature = SCENARIOS[scenario]
    prompts = mixed_prompts(8, COMMON["vocab_size"], seed=2, **prompt_kwargs)
    llm = LLM(model=str(folder), device="cpu", dtype="float32", **llm_kwargs)
    if scenario == "prefix_cache":
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)
    reqs = [llm.make_request(p, GREEDY) for p in prompts]
    for r in reqs:
        llm.add_request(r)
    modes = set()
    while not all(r.finished for r in reqs):
        step = llm.scheduler.schedule()
        assert step is not None
        modes.add(step.batch.forward_mode.name)
        logits = llm.runner.compute_logits(step.batch)
        sampled = [r for r, s in zip(step.reqs, step.batch.sample_mask) if s]
        for row, req in zip(logits, sampled):
            expect = reference_logits(ref, req.fill_ids[:-1])  # the last is this step's placeholder
            torch.testing.assert_close(row, expect, rtol=1e-4, atol=1e-4 * float(expect.abs().max()))
        next_ids = logits.argmax(-1).numpy().astype(np.int64) if len(logits) else np.zeros(0, np.int64)
        llm.scheduler.process_result(step, ForwardResult(next_token_ids=next_ids))
    _check_feature(llm, feature)
    assert "DECODE" in modes
