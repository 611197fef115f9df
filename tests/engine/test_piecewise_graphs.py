"""Piecewise CUDA graphs for EXTEND and MIXED: the model split between its attention calls and
padded to a token bucket computes what the whole model computes, step by step against a plain
engine (teacher-forced). On CPU the pieces run directly (the split, the padding and the static
buffers are what is tested); on a GPU they replay captured graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modeserve.engine import LLM, SamplingParams
from modeserve.engine.config import RunnerConfig
from modeserve.engine.runner.piecewise_graphs import PiecewiseExtend, token_buckets
from tests.engine.tiny_models import COMMON, make_tiny_model, mixed_prompts, teacher_forced_logits

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
SCHED = dict(chunked_prefill_size=16, enable_mixed=True, max_prefill_ratio=0.9, max_running_requests=16)


def test_buckets_cover_every_count_up_to_the_limit() -> None:
    assert token_buckets(20) == [16, 20]
    assert token_buckets(16) == [16]
    assert token_buckets(5) == [5]
    assert token_buckets(600)[-3:] == [384, 512, 600]
    with pytest.raises(ValueError, match="max_tokens"):
        token_buckets(0)
    with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens"):
        RunnerConfig(piecewise_cuda_graph_max_tokens=0)


def _load(llm: LLM, prompts: list[list[int]]) -> None:
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)  # warm the prefix cache: EXTEND with prefix
    for p in prompts:
        llm.add_request(llm.make_request(p, GREEDY))


@pytest.mark.parametrize(("arch", "backend"), [("llama3", "torch"), ("qwen3", "torch"), ("llama3", "triton")])
def test_pieces_equal_the_whole_model_on_cpu(tmp_path: Path, arch: str, backend: str) -> None:
    """``backend``: the attention and elementwise kernels (Triton's in its CPU interpreter: the fused
    rotary + KV store and add-RMSNorm the GPU pieces capture)."""
    if backend == "triton":
        pytest.importorskip("triton")
    folder = make_tiny_model(arch, tmp_path / arch, head_dim=64)
    # fewer prompts through Triton's interpreter (slow on CPU): still EXTEND, MIXED and both buckets
    prompts = mixed_prompts(5 if backend == "triton" else 9, COMMON["vocab_size"], seed=21, shared_prefix=16)
    kw = dict(device="cpu", page_size=4, attention_backend=backend, kernel_backend=backend, **SCHED)
    pw, ref = LLM(model=str(folder), **kw), LLM(model=str(folder), **kw)
    runner = pw.runner
    # buckets 16 and 20: steps of 17-20 tokens are padded, longer MIXED steps stay whole-model
    pieces = PiecewiseExtend(runner.model, runner.attn, 20, runner.device, runner.dtype, capture=False)
    runner.piecewise = pieces
    _load(pw, prompts)
    _load(ref, prompts)
    modes = teacher_forced_logits(pw, ref, rtol=1e-5)
    assert {"EXTEND", "MIXED"} <= modes
    assert set(pieces.hits) == {16, 20} and pieces.padded_tokens > 0
    # padded tokens stored their k/v at the reserved slot 0 only: every other slot holds what the
    # whole model stored
    for layer in range(runner.model_config.num_layers):
        for a, b in ((runner.kv_cache.k[layer], ref.runner.kv_cache.k[layer]),
                     (runner.kv_cache.v[layer], ref.runner.kv_cache.v[layer])):
            torch.testing.assert_close(a[1:], b[1:], rtol=1e-4, atol=1e-5)  # GEMM rounding of other row counts


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flashinfer", "triton", "flashinfer-triton"])
def test_piecewise_graph_replay_equals_eager(tmp_path: Path, backend: str) -> None:
    for module in backend.split("-"):
        pytest.importorskip(module)
    folder = make_tiny_model("llama3", tmp_path / "m", head_dim=64)
    prompts = mixed_prompts(11, COMMON["vocab_size"], seed=22, shared_prefix=16)
    kw = dict(device="cuda", dtype="bfloat16", page_size=16, attention_backend=backend, cuda_graph_max_bs=16, **SCHED)
    pw = LLM(model=str(folder), enable_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=24, **kw)
    eager = LLM(model=str(folder), **kw)
    pieces = pw.runner.piecewise
    assert pieces is not None and eager.runner.piecewise is None and set(pieces.graphs) == {16, 24}
    _load(pw, prompts)
    _load(eager, prompts)
    assert {"EXTEND", "MIXED"} <= teacher_forced_logits(pw, eager, rtol=2e-2)
    assert pieces.hits and pieces.padded_tokens > 0
    outs_p = pw.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    outs_e = eager.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert sum(p.token_ids == e.token_ids for p, e in zip(outs_p, outs_e)) >= len(prompts) - 1  # bf16 near-ties


@pytest.mark.gpu
def test_piecewise_fp32_greedy_equals_transformers(tmp_path: Path) -> None:
    from tests.engine.tiny_models import load_reference, reference_greedy

    folder = make_tiny_model("llama3", tmp_path / "m")
    prompts = mixed_prompts(6, COMMON["vocab_size"], seed=23)
    llm = LLM(model=str(folder), device="cuda", dtype="float32", page_size=16, enable_piecewise_cuda_graph=True,
              piecewise_cuda_graph_max_tokens=64, **SCHED)
    ref = load_reference(folder)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert llm.runner.piecewise is not None and llm.runner.piecewise.hits
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(ref, p, GREEDY.max_new_tokens)
