"""Sampling through the whole engine: seeds are batch-independent, penalties and logprobs equal
references built on the ``transformers`` model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from modeserve.engine import LLM, SamplingParams
from tests.engine.tiny_models import COMMON, load_reference, mixed_prompts, reference_logits


@pytest.fixture(scope="module")
def ref(tiny_llama: Path) -> torch.nn.Module:
    return load_reference(tiny_llama)


def test_same_seed_same_tokens_whatever_the_batch(tiny_llama: Path) -> None:
    prompts = mixed_prompts(8, COMMON["vocab_size"], seed=3)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=10, seed=1234, ignore_eos=True)
    alone = LLM(model=str(tiny_llama)).generate(prompt_token_ids=[prompts[0]], sampling_params=sp)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_new_tokens=10, seed=i, ignore_eos=True) for i in range(7)]
    crowded = LLM(model=str(tiny_llama), page_size=1, chunked_prefill_size=16, kv_cache_tokens=96)
    outs = crowded.generate(prompt_token_ids=prompts[1:] + [prompts[0]], sampling_params=others + [sp])
    assert outs[-1].token_ids == alone
    assert crowded.stats()["num_retractions"] > 0  # recomputation kept the same stream
    other_seed = LLM(model=str(tiny_llama)).generate(prompt_token_ids=[prompts[0]],
                                                     sampling_params=sp.replace(seed=99))[0].token_ids
    assert other_seed != alone


def test_unseeded_requests_differ(tiny_llama: Path) -> None:
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    outs = LLM(model=str(tiny_llama)).generate(prompt_token_ids=[[5, 6, 7]] * 4, sampling_params=sp)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_repetition_penalty_matches_transformers_processor(tiny_llama: Path, ref: torch.nn.Module) -> None:
    prompt = [5, 9, 5, 9, 5, 9, 11, 12]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10, repetition_penalty=1.8, ignore_eos=True)
    out = LLM(model=str(tiny_llama)).generate(prompt_token_ids=[prompt], sampling_params=sp)[0].token_ids
    proc = RepetitionPenaltyLogitsProcessor(1.8)
    ids = list(prompt)
    for _ in range(10):
        logits = proc(torch.tensor([ids]), reference_logits(ref, ids)[None])[0]
        ids.append(int(logits.argmax()))
    assert out == ids[len(prompt):]


def test_frequency_and_presence_penalties_match_openai_formula(tiny_llama: Path, ref: torch.nn.Module) -> None:
    prompt = [5, 9, 5, 9, 11]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10, frequency_penalty=1.5, presence_penalty=0.7,
                        ignore_eos=True)
    out = LLM(model=str(tiny_llama)).generate(prompt_token_ids=[prompt], sampling_params=sp)[0].token_ids
    generated: list[int] = []
    for _ in range(10):
        logits = reference_logits(ref, prompt + generated)
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.numel()).float()
        logits = logits - 1.5 * counts - 0.7 * (counts > 0).float()
        generated.append(int(logits.argmax()))
    assert out == generated


def test_logprobs_match_reference(tiny_llama: Path, ref: torch.nn.Module) -> None:
    prompt = [5, 6, 7, 8, 9]
    sp = SamplingParams(temperature=0.0, max_new_tokens=6, logprobs=3, ignore_eos=True)
    out = LLM(model=str(tiny_llama)).generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
    assert len(out.logprobs) == len(out.top_logprobs) == 6
    ids = list(prompt)
    for tok, chosen, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        lp = torch.log_softmax(reference_logits(ref, ids), -1)
        assert chosen == pytest.approx(float(lp[tok]), abs=1e-4)
        vals, idx = lp.topk(3)
        assert [t for t, _ in top] == idx.tolist()
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-4)
        ids.append(tok)


def test_penalties_see_the_prompt_served_from_the_prefix_cache(tiny_llama: Path) -> None:
    """A prompt whose first pages come from the prefix cache is penalised on those tokens too: the
    engine's token history of the cached positions arrives with the slot update."""
    vocab = COMMON["vocab_size"]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    base = [(7 * i + 3) % vocab for i in range(24)]
    liked = LLM(model=str(tiny_llama)).generate(prompt_token_ids=[base], sampling_params=greedy)[0].token_ids
    prompt = base + liked  # the tokens the model wants next are in the (cached) prompt: penalised
    sp = greedy.replace(repetition_penalty=5.0)
    fresh = LLM(model=str(tiny_llama), enable_prefix_cache=False).generate(prompt_token_ids=[prompt],
                                                                           sampling_params=sp)[0].token_ids
    llm = LLM(model=str(tiny_llama), page_size=4)
    llm.generate(prompt_token_ids=[prompt], sampling_params=sp.replace(max_new_tokens=1))  # caches the prompt
    other = [t for t in range(vocab) if t not in prompt][: len(prompt) + 4]
    llm.generate(prompt_token_ids=[other], sampling_params=sp.replace(max_new_tokens=1))  # reuses the slot
    cached = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
    assert cached.num_cached_tokens >= 32
    assert cached.token_ids == fresh
