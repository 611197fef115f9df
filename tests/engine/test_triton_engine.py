"""The engine with the project's Triton kernels (fused elementwise ops and Triton attention) equals
``transformers``' greedy tokens. Without a GPU the kernels run in Triton's CPU interpreter
(tests/conftest.py), so CI checks them inside the whole model too."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeserve.engine import LLM, SamplingParams
from tests.engine.tiny_models import COMMON, load_reference, make_tiny_model, mixed_prompts, reference_greedy

pytest.importorskip("triton")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "mistral-window"])
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_triton_kernels_greedy_equals_transformers(tmp_path: Path, arch: str, attention: str) -> None:
    folder = make_tiny_model(arch, tmp_path / arch)
    ref = load_reference(folder)
    prompts = mixed_prompts(5, COMMON["vocab_size"], seed=31, max_len=40, shared_prefix=8)
    llm = LLM(model=str(folder), kernel_backend="triton", attention_backend=attention, page_size=4,
              chunked_prefill_size=24, enable_mixed=True, max_prefill_ratio=0.9)
    assert llm.runner.kernel_ops.name == "triton"
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(ref, p, GREEDY.max_new_tokens)
    modes = llm.stats()["mode_distribution"]
    assert modes.get("MIXED", 0) > 0 and modes.get("DECODE", 0) > 0


def test_chained_ngram_verify_through_triton_equals_transformers(tmp_path: Path) -> None:
    """n-gram speculation with overlap through the Triton kernels: chained verify rows resolved by the
    one-launch kernel and attended by the Triton decode kernel, which reads their lengths on the device
    (no wait for them)."""
    from tests.engine.test_speculative import PROMPTS

    folder = make_tiny_model("qwen3", tmp_path / "qwen3")
    ref = load_reference(folder)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    llm = LLM(model=str(folder), kernel_backend="triton", attention_backend="triton", page_size=4,
              speculative_algorithm="ngram", speculative_num_steps=3)
    outs = llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=sp)
    for p, o in zip(PROMPTS[:3], outs):
        assert o.token_ids == reference_greedy(ref, p, sp.max_new_tokens)
    spec = llm.stats()["speculative"]
    assert spec["chained_rows"] > 0 and spec["accepted_tokens"] > 0
