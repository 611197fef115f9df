"""Tensor parallelism on two GPUs (NCCL): bf16 logits of two ranks equal one rank's within bf16
tolerance, step by step, with the decode steps replaying CUDA graphs that hold the all-reduces; the
graph replay equals the eager step of the same two ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from modeserve.engine import LLM, SamplingParams
from tests.engine.tiny_models import COMMON, make_tiny_model, mixed_prompts, teacher_forced_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
PROMPTS = mixed_prompts(8, COMMON["vocab_size"], seed=32, max_len=40)


def stepped_together(test: LLM, ref: LLM, rtol: float) -> set[str]:
    for llm in (test, ref):
        for p in PROMPTS:
            llm.add_request(llm.make_request(p, GREEDY))
    return teacher_forced_logits(test, ref, rtol=rtol)


@pytest.mark.parametrize("backend", ["triton", "flashinfer-triton"])
def test_two_gpus_bf16_logits_equal_one_gpu(tmp_path: Path, backend: str) -> None:
    for module in backend.split("-"):
        pytest.importorskip(module)
    folder = make_tiny_model("llama3", tmp_path / "m", head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    kw: dict[str, Any] = dict(device="cuda", dtype="bfloat16", page_size=16, attention_backend=backend,
                              max_running_requests=16)
    one, two = LLM(model=str(folder), **kw), LLM(model=str(folder), tensor_parallel_size=2, **kw)
    try:
        assert {"EXTEND", "DECODE"} <= stepped_together(two, one, rtol=3e-2)
        assert two.runner.graphs is not None and two.runner.graphs.hits["DECODE"] > 0
    finally:
        two.close()


def test_two_gpus_graph_replay_equals_eager(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    folder = make_tiny_model("llama3", tmp_path / "m", head_dim=64)
    kw: dict[str, Any] = dict(device="cuda", dtype="float32", page_size=16, attention_backend="triton",
                              max_running_requests=16, tensor_parallel_size=2)
    graphs, eager = LLM(model=str(folder), **kw), LLM(model=str(folder), disable_cuda_graph=True, **kw)
    try:
        assert "DECODE" in stepped_together(graphs, eager, rtol=1e-4)
        assert graphs.runner.graphs is not None and graphs.runner.graphs.hits["DECODE"] > 0
    finally:
        graphs.close()
        eager.close()
