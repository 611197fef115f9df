"""Scheduling ahead of results (overlap): with up to three steps in flight, outputs, stops and KV
accounting equal the step-by-step run."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from modeserve.engine import LLM, SamplingParams
from tests.engine.tiny_models import COMMON, mixed_prompts


def run_pipelined(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], depth: int) -> list[list[int]]:
    reqs = [llm.make_request(p, sp) for p, sp in zip(prompts, params)]
    for r in reqs:
        llm.add_request(r)
    in_flight: collections.deque = collections.deque()
    while llm.scheduler.has_work or in_flight:
        step = llm.scheduler.schedule() if len(in_flight) < depth else None
        if step is not None:
            in_flight.append((step, llm.runner.forward(step.batch)))  # the engine runs steps in order
            continue
        done, result = in_flight.popleft()
        llm.scheduler.process_result(done, result)
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("kv_tokens", [4096, 96])
def test_pipelined_steps_equal_step_by_step(tiny_llama: Path, depth: int, kv_tokens: int) -> None:
    prompts = mixed_prompts(10, COMMON["vocab_size"], seed=21, max_len=40, shared_prefix=8)
    kw = dict(page_size=4, kv_cache_tokens=kv_tokens, chunked_prefill_size=24, enable_mixed=True,
              max_prefill_ratio=0.6)
    base = LLM(model=str(tiny_llama), overlap=False, **kw)
    free = base.generate(prompt_token_ids=prompts,
                         sampling_params=SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True))
    # stop tokens taken from the free-running outputs, so several requests stop mid-stream
    params = [SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True,
                             stop_token_ids=(o.token_ids[5],) if i % 2 else ()) for i, o in enumerate(free)]
    expect = [o.token_ids for o in LLM(model=str(tiny_llama), overlap=False, **kw).generate(
        prompt_token_ids=prompts, sampling_params=params)]
    llm = LLM(model=str(tiny_llama), overlap=False, **kw)
    assert run_pipelined(llm, prompts, params, depth) == expect
    assert any(len(e) < 14 for e in expect)
    kv = llm.scheduler.kv
    cached = kv.cache.num_evictable_pages if kv.cache else 0
    assert kv.pool.num_free_pages + cached == kv.pool.num_total_pages
    if kv_tokens == 96:
        assert llm.scheduler.stats.num_retractions > 0


def test_generate_with_overlap_equals_step_by_step(tiny_llama: Path) -> None:
    """``LLM.generate`` launches step N+1 before it reads step N (placeholders resolved on the
    device): seeded sampling, penalties, logprobs, stops and preemption come out as step by step."""
    prompts = mixed_prompts(12, COMMON["vocab_size"], seed=5, max_len=40, shared_prefix=8)
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9, top_p=0.9, top_k=40, seed=100 + i,
                             max_new_tokens=24, ignore_eos=True, repetition_penalty=1.3 if i % 2 else 1.0,
                             presence_penalty=0.5 if i % 4 == 1 else 0.0, logprobs=2 if i % 5 == 0 else None,
                             stop_token_ids=(7,) if i % 6 == 2 else ())
              for i in range(len(prompts))]
    kw = dict(page_size=4, kv_cache_tokens=96, chunked_prefill_size=24, enable_mixed=True, max_prefill_ratio=0.6)
    outs = {}
    for overlap in (False, True):
        llm = LLM(model=str(tiny_llama), overlap=overlap, **kw)
        outs[overlap] = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert llm.scheduler.stats.num_retractions > 0
    for a, b in zip(outs[False], outs[True]):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert a.logprobs == pytest.approx(b.logprobs)
        assert [[t for t, _ in row] for row in a.top_logprobs] == [[t for t, _ in row] for row in b.top_logprobs]
