"""Offline throughput: modeserve's ``LLM.generate`` and ``transformers.generate`` on the same
prompts, same weights, same device, in one run; reports tokens/s of each and their ratio."""

from __future__ import annotations

import argparse
import math
import platform
import random
import time
from typing import Any

import torch

from ...engine import LLM, SamplingParams
from ..cli.engine_args import engine_kwargs

_WORDS = (
    "the model reads a prompt and writes an answer one token at a time while the scheduler "
    "decides which requests run in each step and how many tokens of each prompt it computes "
    "paged memory keeps every key and value of every request so nothing is computed twice"
).split()


def prompt_lengths(num: int, min_tokens: int, max_tokens: int, dist: str) -> list[int]:
    """Deterministic lengths over [min_tokens, max_tokens]: evenly spaced (``uniform``) or evenly
    spaced in log space (``loguniform``: many short prompts and a long tail, like chat traffic)."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    fractions = [i / max(num - 1, 1) for i in range(num)]
    if dist == "uniform":
        return [round(min_tokens + (max_tokens - min_tokens) * f) for f in fractions]
    if dist == "loguniform":
        lo, hi = math.log(min_tokens), math.log(max_tokens)
        return [round(math.exp(lo + (hi - lo) * f)) for f in fractions]
    raise ValueError(f"unknown length distribution {dist!r} (uniform, loguniform)")


def make_prompts(llm: LLM, lengths: list[int], seed: int) -> list[list[int]]:
    """Token-id prompts of the given lengths, from a fixed word list, in shuffled order."""
    rng = random.Random(seed)
    prompts = []
    for i, target in enumerate(lengths):
        words = [rng.choice(_WORDS) for _ in range(target * 2)]
        ids = llm.encode(f"Question {i}: " + " ".join(words))[:target]
        prompts.append(ids)
    rng.shuffle(prompts)
    return prompts


def _time_modeserve(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=sp.replace(max_new_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    seconds = time.perf_counter() - start
    n_out = sum(len(o.token_ids) for o in outs)
    return {"seconds": round(seconds, 3), "output_tokens": n_out, "output_tokens_per_s": round(n_out / seconds, 2)}


def _reference_model(llm: LLM) -> Any:
    """The same weights in ``transformers``' own Llama implementation."""
    import transformers

    from ...engine.models.loader import iter_weights, open_checkpoint, torch_dtype

    ckpt = open_checkpoint(llm.config.runner.model or "")
    dtype = torch_dtype(llm.config.runner.torch_dtype_name)
    if ckpt.is_gguf:
        from ...engine.models.gguf_loader import read_gguf_checkpoint

        raw = dict(read_gguf_checkpoint(ckpt.path).config)
        cfg = transformers.AutoConfig.for_model(str(raw.pop("model_type")), **raw)
        model: Any = transformers.AutoModelForCausalLM.from_config(cfg)
        missing, unexpected = model.load_state_dict(dict(iter_weights(ckpt, dtype)), strict=False)
        if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()):
            raise ValueError(f"reference model does not match the checkpoint: {missing[:3]} {unexpected[:3]}")
        model.tie_weights()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=dtype)
    return model.to(dtype=dtype, device=llm.config.runner.device).eval()


@torch.inference_mode()
def _time_transformers(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int,
                       batch_size: int) -> dict[str, Any]:
    def run(batch: list[list[int]], n: int) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id)
        return int(out.shape[0] * (out.shape[1] - width))

    run(prompts[:2], 2)  # warm-up
    start = time.perf_counter()
    n_out = sum(run(prompts[i : i + batch_size], new_tokens) for i in range(0, len(prompts), batch_size))
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 3), "output_tokens": n_out, "output_tokens_per_s": round(n_out / seconds, 2),
            "batch_size": batch_size, "padding": "left"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(model=args.model, **engine_kwargs(args))
    lengths = prompt_lengths(args.num_prompts, args.min_prompt_tokens, args.max_prompt_tokens, args.length_dist)
    prompts = make_prompts(llm, lengths, args.seed)
    result: dict[str, Any] = {
        "bench": "offline",
        "model": llm.model_config.name,
        "device": llm.config.runner.device,
        "dtype": llm.config.runner.torch_dtype_name,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "num_prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_len_min_max": [min(map(len, prompts)), max(map(len, prompts))],
        "prompt_len_dist": args.length_dist,
        "new_tokens_per_prompt": args.new_tokens,
    }
    result["modeserve"] = _time_modeserve(llm, prompts, args.new_tokens)
    result["modeserve"]["mode_stats"] = llm.stats()["mode_distribution"]
    if args.baseline == "transformers":
        ref = _reference_model(llm)
        pad = llm.tokenizer.eos_token_ids[0] if llm.tokenizer and llm.tokenizer.eos_token_ids else 0
        result["transformers"] = _time_transformers(ref, prompts, args.new_tokens, pad,
                                                    args.baseline_batch_size or len(prompts))
        result["speedup_vs_transformers"] = round(
            result["modeserve"]["output_tokens_per_s"] / result["transformers"]["output_tokens_per_s"], 3
        )
    return result
