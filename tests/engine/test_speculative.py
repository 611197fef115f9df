"""Speculative decoding on CPU, with n-gram drafts and with a draft model (TARGET_VERIFY, and the
draft's DRAFT_EXTEND and DECODE steps inside the engine): greedy output equals
non-speculative greedy and the transformers full-forward argmax loop, on every tiny architecture and
under page sizes 1 and 16, chunked prefill, prefix-cache hits, preemption, k = 1 and k = 5; seeded
sampling, penalties, log-probabilities and stop tokens are token for token the non-speculative ones
(both drafters' proposals are one-hot: a draft is kept exactly when the target's own seeded draw
equals it); drafts are accepted and their KV comes back; a bad draft model is refused at start."""

from __future__ import annotations

import dataclasses

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from modeserve.engine import LLM, SamplingParams
from modeserve.engine.forward_batch import ForwardResult
from modeserve.engine.forward_mode import ForwardMode
from tests.engine.tiny_models import ARCHS, load_reference, make_tiny_model, reference_greedy

NEW_TOKENS = 24
# repeats make prompt lookup find drafts; lengths 9 .. 60
PROMPTS = [([5 + i, 6, 7, 8, 9 + i] * (2 + i % 5) + [40 + i] * (i % 3))[: 9 + 7 * i] for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
BASE: dict[str, Any] = dict(page_size=16, kv_cache_tokens=8192)
VARIANTS: dict[str, dict[str, Any]] = {
    "page1": dict(page_size=1),
    "page16": dict(page_size=16),
    "chunked": dict(page_size=4, chunked_prefill_size=8),
    "prefix_hits": dict(page_size=4),  # the prompts run twice: the second time from the cache
    "preempted": dict(page_size=4, kv_cache_tokens=192),
    "k1": dict(speculative_num_steps=1),
    "k5": dict(speculative_num_steps=5),
    "no_overlap": dict(overlap=False),  # no verify step is built while another runs (none chained)
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    ref = load_reference(folder)
    return folder, [reference_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]


def spec_llm(folder: Path, algorithm: str = "ngram", draft: Path | None = None, **kwargs: Any) -> LLM:
    """n-gram drafts, or a draft model (by default the target itself: every draft is kept)."""
    spec: dict[str, Any] = dict(speculative_algorithm=algorithm)
    if algorithm == "draft":
        spec["speculative_draft_model"] = str(draft or folder)
    return LLM(model=str(folder), **spec, **{**BASE, **kwargs})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_greedy_equals_plain_greedy_and_transformers(arch: tuple[Path, list[list[int]]], algorithm: str,
                                                     variant: str) -> None:
    folder, want = arch
    kwargs = VARIANTS[variant]
    plain = LLM(model=str(folder), **{**BASE, **kwargs})
    assert [o.token_ids for o in plain.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == want
    llm = spec_llm(folder, algorithm, **kwargs)
    runs = 2 if variant == "prefix_hits" else 1
    for _ in range(runs):
        got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
        assert got == want
    stats = llm.stats()
    spec = stats["speculative"]
    assert stats["mode_distribution"].get("TARGET_VERIFY", 0) == spec["verify_steps"] > 0
    assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    # with overlap, n-gram verify steps chain (built while the request's last one runs, drafted on the
    # device); the draft model's never do
    assert (spec["chained_rows"] > 0) == (algorithm == "ngram" and variant != "no_overlap")
    if algorithm == "draft":  # the draft's prefill and catch-ups, and its own decode steps (k > 1)
        assert stats["mode_distribution"]["DRAFT_EXTEND"] > spec["verify_steps"]
        assert variant == "k1" or stats["mode_distribution"]["DECODE"] > 0
    if variant == "prefix_hits":
        assert stats["num_prefix_hit_tokens"] > 0
    if variant == "preempted":
        assert stats["num_retractions"] > 0
    # every KV page is back (the rejected drafts' included): the pool is full again, less what the cache holds
    kv = llm.scheduler.kv
    assert kv.num_available_pages == kv.pool.num_total_pages


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.mark.parametrize("name, sp", [
    ("seeded", SamplingParams(temperature=0.7, top_k=8, max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=11)),
    ("top_p", SamplingParams(temperature=0.5, top_p=0.8, max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=3)),
    ("penalties", SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3,
                                 max_new_tokens=NEW_TOKENS, ignore_eos=True)),
    ("logprobs", SamplingParams(temperature=0.0, logprobs=3, max_new_tokens=NEW_TOKENS, ignore_eos=True)),
])
@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_sampling_is_token_for_token_the_plain_sampler(qwen: Path, algorithm: str, name: str,
                                                       sp: SamplingParams) -> None:
    want = LLM(model=str(qwen), **BASE).generate(prompt_token_ids=PROMPTS, sampling_params=sp)
    llm = spec_llm(qwen, algorithm)
    got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if name == "logprobs":
        for g, w in zip(got, want):
            assert g.logprobs is not None and w.logprobs is not None and len(g.logprobs) == NEW_TOKENS
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)
            assert [[t for t, _ in row] for row in g.top_logprobs] == [[t for t, _ in row] for row in w.top_logprobs]
    assert llm.stats()["speculative"]["verify_steps"] > 0


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_greedy_with_mixed_steps(qwen: Path, algorithm: str) -> None:
    """Prefill chunks riding with decodes (MIXED) while other requests verify drafts."""
    kwargs = dict(page_size=4, chunked_prefill_size=8, enable_mixed=True, max_prefill_ratio=0.5)
    want = [o.token_ids for o in LLM(model=str(qwen), **{**BASE, **kwargs}).generate(
        prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    llm = spec_llm(qwen, algorithm, **kwargs)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == want
    stats = llm.stats()
    assert stats["mode_distribution"].get("MIXED", 0) > 0 and stats["speculative"]["accepted_tokens"] > 0


def test_stop_tokens_give_the_plain_streams(qwen: Path) -> None:
    plain = LLM(model=str(qwen), **BASE)
    free = [o.token_ids for o in plain.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    stop = next(t for t in free[0][4:] if free[0].count(t) > 1)  # emitted more than once: maybe inside a run
    sp = GREEDY.replace(stop_token_ids=[stop])
    want = plain.generate(prompt_token_ids=PROMPTS, sampling_params=sp)
    got = spec_llm(qwen).generate(prompt_token_ids=PROMPTS, sampling_params=sp)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert got[0].token_ids[-1] == stop and got[0].finish_reason == "stop"


def test_a_stop_inside_an_accepted_run_ends_the_request_at_that_token(qwen: Path) -> None:
    """Scheduler and results only (made here): the target keeps all 4 drafts of a request, and the
    second token of its run is a stop id. The request ends there, the tokens after it are dropped, its KV is back."""
    llm = spec_llm(qwen, page_size=4)
    prompt = [7, 8, 9, 10] * 4
    req = llm.make_request(prompt, GREEDY.replace(stop_token_ids=[301]))
    llm.add_request(req)
    sched = llm.scheduler
    prefill = sched.schedule()
    assert prefill is not None
    sched.process_result(prefill, ForwardResult(next_token_ids=np.array([7])))  # the prompt's next token: 7
    step = sched.schedule()
    assert step is not None and step.batch.forward_mode == ForwardMode.TARGET_VERIFY
    assert step.batch.input_ids.tolist() == [7, 8, 9, 10, 7]  # its last token, then what followed "9 10 7"
    events = sched.process_result(step, ForwardResult(next_token_ids=np.array([8, 301, 10, 7, 99]),
                                                      accepted_lengths=np.array([4])))
    assert [(e.new_token_ids, e.finished) for e in events] == [((8, 301), True)]
    assert req.output_ids[-2:] == [8, 301] and req.finish_reason == "stop"
    assert sched.kv.num_available_pages == sched.kv.pool.num_total_pages


def test_a_draft_of_another_architecture_gives_the_plain_greedy_streams(tmp_path: Path, qwen: Path) -> None:
    """A llama draft for a qwen2 target (same vocabulary, other weights): its drafts are mostly
    rejected, the output is still exactly non-speculative greedy, and every KV page comes back."""
    draft = make_tiny_model("llama3", tmp_path / "draft")
    for kwargs in (dict(page_size=16), dict(page_size=4, kv_cache_tokens=192)):
        want = [o.token_ids for o in LLM(model=str(qwen), **{**BASE, **kwargs}).generate(
            prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
        llm = spec_llm(qwen, "draft", draft, **kwargs)
        assert [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == want
        stats = llm.stats()
        assert stats["speculative"]["verify_steps"] > 0 and stats["mode_distribution"]["DRAFT_EXTEND"] > 0
        kv = llm.scheduler.kv
        assert kv.num_available_pages == kv.pool.num_total_pages


def test_bad_draft_models_are_refused_at_start(tmp_path: Path, qwen: Path) -> None:
    with pytest.raises(ValueError, match="speculative_draft_model"):
        LLM(model=str(qwen), speculative_algorithm="draft")
    with pytest.raises(ValueError, match="speculative_draft_model"):
        LLM(model=str(qwen), speculative_algorithm="ngram", speculative_draft_model=str(qwen))
    other = make_tiny_model("llama3", tmp_path / "v", vocab_size=200)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model=str(qwen), speculative_algorithm="draft", speculative_draft_model=str(other))
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(qwen), speculative_algorithm="draft", speculative_draft_model=str(tmp_path / "none"))


def test_bad_speculative_arguments_are_refused(qwen: Path) -> None:
    with pytest.raises(ValueError, match="speculative_algorithm"):
        LLM(model=str(qwen), speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="speculative_num_steps"):
        LLM(model=str(qwen), speculative_algorithm="ngram", speculative_num_steps=0)
    with pytest.raises(ValueError, match="speculative_ngram_min"):
        LLM(model=str(qwen), speculative_algorithm="ngram", speculative_ngram_min=3, speculative_ngram_max=2)


def chi_square_p(a: list[int], b: list[int], vocab: int) -> float:
    """Two-sample chi-square test of homogeneity over token ids: the p-value that ``a`` and ``b`` are
    draws from one distribution (cells seen in neither sample dropped)."""
    counts = torch.stack([torch.bincount(torch.tensor(x), minlength=vocab) for x in (a, b)]).double()  # [2, V]
    counts = counts[:, counts.sum(0) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def accept_every_draft(sampled: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor,
                       lens: torch.Tensor, slots: torch.Tensor, last_token: torch.Tensor, fill_len: torch.Tensor,
                       max_len: int) -> torch.Tensor:
    """A wrong acceptance rule: every draft kept (and emitted), whatever the target says."""
    from modeserve.kernels.accept import accept_runs

    runs = torch.repeat_interleave(torch.arange(starts.shape[0]), lens, output_size=sampled.shape[0])
    sampled[:-1] = torch.where(runs[1:] == runs[:-1], input_ids[1:], sampled[:-1])
    return accept_runs(sampled, input_ids, positions, starts, lens, slots, last_token, fill_len, max_len)


@pytest.mark.parametrize("rule, algorithm", [("exact", "ngram"), ("accept_every_draft", "ngram"),
                                             ("exact", "draft"), ("accept_every_draft", "draft")])
def test_sampled_token_frequencies_match_plain_sampling(tmp_path: Path, rule: str, algorithm: str) -> None:
    """A 16-token vocabulary, temperature 1, 400 seeds: the tokens sampled with drafts (n-gram, or
    the model drafting for itself) and without are one distribution (chi-square, alpha = 0.01); a wrong acceptance rule is caught."""
    vocab = 16
    folder = make_tiny_model("qwen2", tmp_path / "m", vocab_size=vocab)
    prompt = [3, 4, 5, 6] * 6
    reqs = 400
    sps = [SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=s) for s in range(reqs)]
    plain = LLM(model=str(folder), **BASE).generate(prompt_token_ids=[prompt] * reqs, sampling_params=sps)
    llm = spec_llm(folder, algorithm)
    if rule != "exact":
        llm.runner.sampler.kernel_ops = dataclasses.replace(llm.runner.kernel_ops, accept_runs=accept_every_draft)
    spec = llm.generate(prompt_token_ids=[prompt] * reqs, sampling_params=sps)
    assert llm.stats()["speculative"]["draft_tokens"] > reqs
    p = chi_square_p([t for o in plain for t in o.token_ids], [t for o in spec for t in o.token_ids], vocab)
    if rule == "exact":
        assert p > 0.01
    else:
        assert p < 0.01
