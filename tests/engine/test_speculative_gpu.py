"""Speculative decoding on a CUDA device: the TARGET_VERIFY step's k+1 queries a request over the
paged cache, through each attention backend: fp32 greedy output (n-gram drafts and a draft model) is
exactly the transformers argmax loop's, replaying the verify and draft-decode CUDA graphs; bf16
verify logits equal the torch reference backend's (teacher-forced: a greedy comparison of two bf16
kernels flips on near-ties); a verify graph's replay equals the eager step, logit for logit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modeserve.engine import LLM, SamplingParams
from tests.engine.test_speculative import PROMPTS
from tests.engine.tiny_models import load_reference, make_tiny_model, reference_greedy, teacher_forced_logits

pytestmark = pytest.mark.gpu
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def accepted(llm: LLM) -> dict[str, Any]:
    stats = llm.stats()
    spec = stats["speculative"]
    assert stats["mode_distribution"].get("TARGET_VERIFY", 0) == spec["verify_steps"] > 0
    assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    return spec


def replayed(llm: LLM) -> None:
    """Verify steps replayed graphs, and so did the draft model's decode steps (if it has one)."""
    assert llm.runner.verify_graphs is not None and llm.runner.verify_graphs.hits["TARGET_VERIFY"] > 0
    if llm.runner.draft is not None:
        assert llm.runner.draft.graphs is not None and llm.runner.draft.graphs.hits["DECODE"] > 0


def draft_kwargs(algorithm: str, tmp_path: Path, head_dim: int | None = None) -> dict[str, Any]:
    """n-gram drafts, or a draft model of other random weights (some drafts kept, some not)."""
    if algorithm == "ngram":
        return dict(speculative_algorithm="ngram")
    extra = {} if head_dim is None else dict(head_dim=head_dim)
    return dict(speculative_algorithm="draft",
                speculative_draft_model=str(make_tiny_model("llama3", tmp_path / "draft", seed=1, **extra)))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama3", "qwen3", "mistral-window"])
@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_fp32_greedy_equals_transformers(tmp_path: Path, algorithm: str, arch: str, page_size: int) -> None:
    folder = make_tiny_model(arch, tmp_path / arch)
    ref = load_reference(folder)
    kw: dict[str, Any] = dict(device="cuda", dtype="float32", page_size=page_size, max_running_requests=16)
    # a llama draft of other weights for the llama target (some drafts kept); the others draft for
    # themselves (an unrelated random draft keeps none, and the test wants kept drafts)
    draft = draft_kwargs(algorithm, tmp_path) if arch == "llama3" or algorithm == "ngram" else dict(
        speculative_algorithm="draft", speculative_draft_model=str(folder))
    llm = LLM(model=str(folder), **draft, **kw)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == [reference_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    accepted(llm)
    replayed(llm)
    kv = llm.scheduler.kv
    assert kv.num_available_pages == kv.pool.num_total_pages


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["triton", "flashinfer", "flashinfer-triton"])
@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_verify_graph_replay_equals_eager(tmp_path: Path, algorithm: str, backend: str, page_size: int) -> None:
    """The same requests stepped together through an engine that replays the verify (and draft decode)
    graphs and one that runs every step eagerly: equal logits at every step (fp32 for Triton, bf16
    for FlashInfer's kernels)."""
    for module in backend.split("-"):
        pytest.importorskip(module)
    dtype, rtol = ("float32", 1e-4) if backend == "triton" else ("bfloat16", 2e-2)
    folder = make_tiny_model("llama3", tmp_path / "m", head_dim=64)
    kw: dict[str, Any] = dict(device="cuda", dtype=dtype, page_size=page_size, max_running_requests=16,
                              attention_backend=backend, kernel_backend="triton",
                              **draft_kwargs(algorithm, tmp_path, head_dim=64))
    graphs, eager = LLM(model=str(folder), **kw), LLM(model=str(folder), disable_cuda_graph=True, **kw)
    assert eager.runner.verify_graphs is None
    for llm in (graphs, eager):
        for p in PROMPTS:
            llm.add_request(llm.make_request(p, GREEDY))
    assert "TARGET_VERIFY" in teacher_forced_logits(graphs, eager, rtol=rtol)
    replayed(graphs)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["flashinfer", "triton", "flashinfer-triton"])
def test_bf16_verify_logits_equal_torch_reference(tmp_path: Path, backend: str, page_size: int) -> None:
    """The k+1 queries a request of a TARGET_VERIFY step over the paged cache, in bf16: each backend's
    logits equal the torch reference backend's, step by step (teacher-forced, drafts by n-gram)."""
    for module in backend.split("-"):
        pytest.importorskip(module)
    folder = make_tiny_model("llama3", tmp_path / "m", head_dim=64)  # FlashInfer's Hopper kernels: 64/128/256
    kw: dict[str, Any] = dict(device="cuda", dtype="bfloat16", page_size=page_size, max_running_requests=16,
                              speculative_algorithm="ngram")
    test = LLM(model=str(folder), attention_backend=backend, kernel_backend="triton", **kw)
    ref = LLM(model=str(folder), attention_backend="torch", kernel_backend="torch", **kw)
    assert test.runner.attention_backend_name == backend
    for llm in (test, ref):
        for p in PROMPTS:
            llm.add_request(llm.make_request(p, GREEDY))
    assert "TARGET_VERIFY" in teacher_forced_logits(test, ref, rtol=5e-2)
    assert test.stats()["speculative"]["accepted_tokens"] > 0
