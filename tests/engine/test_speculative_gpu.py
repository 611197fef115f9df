"""n-gram speculative decoding on a CUDA device: the TARGET_VERIFY step's k+1 queries a request over
the paged cache, through each attention backend, give non-speculative greedy tokens (fp32: exactly
the transformers argmax loop; bf16: the same tokens as the backend's own plain decode, bar near-ties)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modeserve.engine import LLM, SamplingParams
from tests.engine.test_speculative import PROMPTS
from tests.engine.tiny_models import load_reference, make_tiny_model, reference_greedy

pytestmark = pytest.mark.gpu
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def accepted(llm: LLM) -> dict[str, Any]:
    stats = llm.stats()
    spec = stats["speculative"]
    assert stats["mode_distribution"].get("TARGET_VERIFY", 0) == spec["verify_steps"] > 0
    assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    return spec


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama3", "qwen3", "mistral-window"])
def test_fp32_ngram_greedy_equals_transformers(tmp_path: Path, arch: str, page_size: int) -> None:
    folder = make_tiny_model(arch, tmp_path / arch)
    ref = load_reference(folder)
    kw: dict[str, Any] = dict(device="cuda", dtype="float32", page_size=page_size, max_running_requests=16)
    llm = LLM(model=str(folder), speculative_algorithm="ngram", **kw)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == [reference_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    accepted(llm)
    kv = llm.scheduler.kv
    assert kv.num_available_pages == kv.pool.num_total_pages


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_bf16_ngram_greedy_equals_plain_greedy(tmp_path: Path, backend: str, page_size: int) -> None:
    pytest.importorskip(backend)
    folder = make_tiny_model("llama3", tmp_path / "m", head_dim=64)  # FlashInfer's Hopper kernels: 64/128/256
    kw: dict[str, Any] = dict(device="cuda", dtype="bfloat16", page_size=page_size, attention_backend=backend,
                              max_running_requests=16)
    want = LLM(model=str(folder), **kw).generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    llm = LLM(model=str(folder), speculative_algorithm="ngram", **kw)
    got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert llm.runner.attention_backend_name == backend
    same = sum(g.token_ids == w.token_ids for g, w in zip(got, want))
    assert same >= len(PROMPTS) - 1  # bf16: the prefill-style kernel may flip one near-tie
    accepted(llm)
