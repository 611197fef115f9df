"""The same workload through Hugging Face ``transformers`` on the same device: the peer figure
next to modeserve's in the GPU benchmarks (eager ``generate``, greedy, the EOS masked)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from .limits import sync


def load_transformers(folder: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """The folder's model built from its config.json alone, random weights made on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _generate_seconds(model: Any, prompts: torch.Tensor, new_tokens: int) -> float:
    sync(prompts.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync(prompts.device)
    return time.perf_counter() - start


def transformers_latency(folder: Path, prompts: torch.Tensor, output_len: int, dtype: torch.dtype,
                         repeats: int = 3) -> dict[str, float]:
    """Prefill and mean decode step of ``generate`` on ``prompts`` [B, L] (one batch, no padding): the
    fastest of ``repeats`` runs of one token and of ``output_len`` (the decode step is their
    difference, which one slow run on a loaded machine could even make negative)."""
    model = load_transformers(folder, dtype, prompts.device)
    _generate_seconds(model, prompts, 2)  # warm-up
    prefill = min(_generate_seconds(model, prompts, 1) for _ in range(repeats))
    total = min(_generate_seconds(model, prompts, output_len) for _ in range(repeats))
    del model
    torch.cuda.empty_cache()
    return {"prefill_ms": round(prefill * 1e3, 3), "decode_step_ms": round((total - prefill) / (output_len - 1) * 1e3, 4),
            "output_len": output_len}


def transformers_throughput(folder: Path, prompts: torch.Tensor, output_len: int, dtype: torch.dtype,
                            batch_size: int) -> dict[str, float]:
    """Output tokens/s of ``generate`` over ``prompts`` [N, L] in batches of ``batch_size``."""
    model = load_transformers(folder, dtype, prompts.device)
    _generate_seconds(model, prompts[:batch_size], 2)  # warm-up
    seconds = sum(_generate_seconds(model, prompts[i : i + batch_size], output_len)
                  for i in range(0, len(prompts), batch_size))
    del model
    torch.cuda.empty_cache()
    return {"num_prompts": len(prompts), "batch_size": batch_size, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(len(prompts) * output_len / seconds, 1)}
