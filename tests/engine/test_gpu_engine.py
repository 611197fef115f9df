"""The engine on a CUDA device: fp32 greedy equals transformers; the FlashInfer backend's logits
equal the torch reference backend's in bf16, step by step (teacher-forced), in every mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeserve.engine import LLM, SamplingParams
from tests.engine.tiny_models import (COMMON, load_reference, make_tiny_model, mixed_prompts, reference_greedy,
                                     teacher_forced_logits)

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
SCHED = dict(chunked_prefill_size=16, enable_mixed=True, max_prefill_ratio=0.9, max_running_requests=16)  # 16: few graphs


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "mistral-window"])
def test_fp32_cuda_greedy_equals_transformers(tmp_path: Path, arch: str) -> None:
    folder = make_tiny_model(arch, tmp_path / arch)
    ref = load_reference(folder)
    prompts = mixed_prompts(8, COMMON["vocab_size"], seed=11)
    llm = LLM(model=str(folder), device="cuda", dtype="float32", page_size=16, **SCHED)
    assert llm.runner.kernel_ops.name == "triton" and llm.runner.attention_backend_name == "triton"  # auto, fp32
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(ref, p, 10)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama3", "mistral-window", "qwen3"])
@pytest.mark.parametrize("backend", ["flashinfer", "triton", "flashinfer-triton"])
def test_backend_logits_equal_torch_reference_bf16(tmp_path: Path, arch: str, page_size: int, backend: str) -> None:
    """Attention backend and fused Triton ops against the torch references (attention and ops),
    teacher-forced step by step in EXTEND, MIXED and DECODE."""
    for module in backend.split("-"):
        pytest.importorskip(module)
    folder = make_tiny_model(arch, tmp_path / arch, head_dim=64)  # FlashInfer's Hopper kernels: 64/128/256
    prompts = mixed_prompts(8, COMMON["vocab_size"], seed=12, shared_prefix=16)
    kw = dict(device="cuda", dtype="bfloat16", page_size=page_size, **SCHED)
    fi = LLM(model=str(folder), attention_backend=backend, kernel_backend="triton", **kw)
    ref = LLM(model=str(folder), attention_backend="torch", kernel_backend="torch", **kw)
    assert fi.runner.attention_backend_name == backend
    for llm in (fi, ref):
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)  # warm the prefix cache
        for p in prompts:
            llm.add_request(llm.make_request(p, GREEDY))
    assert {"MIXED", "DECODE"} <= teacher_forced_logits(fi, ref, rtol=5e-2)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["flashinfer", "triton", "flashinfer-triton"])
def test_cuda_graph_replay_equals_eager(tmp_path: Path, page_size: int, backend: str) -> None:
    for module in backend.split("-"):
        pytest.importorskip(module)
    folder = make_tiny_model("llama3", tmp_path / "m", head_dim=64)
    prompts = mixed_prompts(11, COMMON["vocab_size"], seed=13)  # 11 rows: padded to the 12 bucket
    kw = dict(device="cuda", dtype="bfloat16", page_size=page_size, attention_backend=backend,
              cuda_graph_max_bs=16, **SCHED)
    graphs, eager = LLM(model=str(folder), **kw), LLM(model=str(folder), disable_cuda_graph=True, **kw)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    for llm in (graphs, eager):
        for p in prompts:
            llm.add_request(llm.make_request(p, GREEDY))
    teacher_forced_logits(graphs, eager, rtol=2e-2)
    stats = graphs.runner.graphs.stats()
    assert stats["hits"]["DECODE"] > 0 and stats["padded_rows"]["DECODE"] > 0
    # and the whole generate path gives the same greedy tokens with and without graphs
    outs_g = graphs.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    outs_e = eager.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    agree = sum(g.token_ids == e.token_ids for g, e in zip(outs_g, outs_e))
    assert agree >= len(prompts) - 1  # bf16: at most one near-tie may flip


def test_fused_sampling_in_the_engine_draws_the_reference_tokens(tmp_path: Path) -> None:
    """Seeded top-k/top-p/min-p sampling through the engine: the fused Triton kernels (sampling step
    included) draw the tokens the torch references draw, and the draws are not all greedy."""
    folder = make_tiny_model("llama3", tmp_path / "m")
    prompts = mixed_prompts(8, COMMON["vocab_size"], seed=14)
    sp = SamplingParams(temperature=1.3, top_p=0.95, top_k=50, min_p=0.01, seed=7, max_new_tokens=12, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", page_size=16, **SCHED)
    fused = LLM(model=str(folder), kernel_backend="triton", **kw)
    ref = LLM(model=str(folder), kernel_backend="torch", attention_backend="torch", **kw)
    assert fused.runner.kernel_ops.name == "triton" and ref.runner.kernel_ops.name == "torch"
    outs_f = fused.generate(prompt_token_ids=prompts, sampling_params=sp)
    outs_r = ref.generate(prompt_token_ids=prompts, sampling_params=sp)
    agree = sum(f.token_ids == r.token_ids for f, r in zip(outs_f, outs_r))
    assert agree >= len(prompts) - 1  # fp32 kernels vs references: at most one near-tie may flip
    greedy = fused.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert sum(f.token_ids[:10] != g.token_ids for f, g in zip(outs_f, greedy)) >= len(prompts) // 2
