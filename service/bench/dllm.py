"""What a DLLM_EXTEND step (block diffusion, SDAR) costs against an autoregressive DECODE step of the same
shape, on random weights: per block size and batch size, ``batch`` requests denoise one block each a step,
and the same shape as a Qwen3 model decodes ``batch`` requests over the same context lengths.

Each step is ``LLM.step()`` timed on the wall (host work included, the device synced at both ends); the
figures are medians over the steady steps: those after every request's first block (its prompt's prefill)
is committed. A block's first step also carries the block committed before it (its keys and values are
written then), so it runs 2 x block tokens a request and the others 1 x block; both medians are reported.

From the costs, tok/s as a function of the tokens a step commits per request (c = 1, 2, 4 .. block): flat
(``batch * c / step``, the median step) and with the commit steps counted (a block takes block / c steps,
the first of them the longer one). Random weights commit one token a step (LowConfidence at the default
threshold), which the measured ``dllm_unmasked_per_step`` shows: the curve is what the costs allow, not a
speed-up anyone has seen."""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch

from ...engine.config import RunnerConfig
from ...engine.models.random_checkpoint import preset_config, sdar_config, write_config_only
from ...engine.sampling_params import SamplingParams
from .batch import add_batch, add_runner_flags, config_file, engine_kwargs, random_prompts
from .limits import device_name, ratio, sync


class StepTime(NamedTuple):
    seconds: float
    mode: str
    num_tokens: int


class Timed(NamedTuple):
    """The steady steps of one run, and the tokens a DLLM_EXTEND step unmasked a request over the run."""

    steps: list[StepTime]
    unmasked: dict[int, int]


def _device_defaults(device: str) -> dict[str, Any]:
    """The issue's H200 setting, or a small shape that runs in a minute or two on CPU."""
    if device.startswith("cuda"):
        return {"shape": "sdar-1.7b", "prompt_len": 512}
    return {"shape": "small", "prompt_len": 128}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runner_flags(p, shape=None, device="cpu")
    p.set_defaults(attention_backend=None)  # dllm_backend(): block-causal attention runs on torch and triton
    cuda, cpu = _device_defaults("cuda"), _device_defaults("cpu")
    p.description = (f"--shape default: {cuda['shape']} on CUDA, {cpu['shape']} on CPU; its dimensions as an SDAR "
                     "model and as a Qwen3 one")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[4, 32])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=None,
                   help=f"prompt tokens a request (default: {cuda['prompt_len']} on CUDA, {cpu['prompt_len']} on CPU)")
    p.add_argument("--blocks", type=int, default=2, help="blocks a request denoises in the timed steps")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="default: the shape's mask_token_id, else its last token id")
    p.add_argument("--decode-attention-backend", default=None,
                   help="the DECODE engine's attention backend (default: 'auto', the serving decode path, CUDA "
                        "graphs included on CUDA; on CPU --attention-backend's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 on a busy machine: idle threads spin otherwise)")


def dllm_backend(args: argparse.Namespace) -> str:
    """--attention-backend, else the backend whose DLLM_EXTEND steps replay CUDA graphs (triton) on CUDA, torch
    on CPU."""
    return args.attention_backend or ("triton" if args.device.startswith("cuda") else "torch")


def decode_backend(args: argparse.Namespace) -> str:
    """--decode-attention-backend, else the serving path on CUDA ('auto') and the DLLM engine's on CPU."""
    if args.decode_attention_backend:
        return str(args.decode_attention_backend)
    return "auto" if args.device.startswith("cuda") else dllm_backend(args)


def autoregressive_config(base: dict[str, Any]) -> dict[str, Any]:
    """``base``'s dimensions as a Qwen3 model (SDAR's weight layout), no block."""
    cfg = {k: v for k, v in base.items() if k not in ("block_size", "mask_token_id")}
    return {**cfg, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}


def committed_levels(block_size: int) -> list[int]:
    """1, 2, 4 .. up to the block size (the block size itself last)."""
    out = [1]
    while out[-1] * 2 < block_size:
        out.append(out[-1] * 2)
    return out + [block_size] if block_size > 1 else out


def timed_steps(llm: Any, prompts: list[list[int]], new_tokens: int, warm_tokens: int) -> Timed:
    """``prompts`` added at once and stepped until done; each step after every request has ``warm_tokens``
    outputs timed."""
    stats = llm.scheduler.stats
    unmasked0 = Counter(stats.dllm_unmasked)
    reqs = add_batch(llm, prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    steps: list[StepTime] = []
    while not all(r.finished for r in reqs):
        warm = all(len(r.output_ids) >= warm_tokens for r in reqs)
        counts, tokens = dict(stats.mode_counts), dict(stats.mode_tokens)
        sync(llm.runner.device)
        start = time.perf_counter()
        llm.step()
        sync(llm.runner.device)
        seconds = time.perf_counter() - start
        modes = [m for m, n in stats.mode_counts.items() if n != counts.get(m, 0)]
        if len(modes) != 1:
            raise RuntimeError(f"a step ran {modes or 'nothing'} with requests unfinished")
        if warm:
            steps.append(StepTime(seconds, modes[0], stats.mode_tokens[modes[0]] - tokens.get(modes[0], 0)))
    unmasked = Counter(stats.dllm_unmasked)
    unmasked.subtract(unmasked0)
    return Timed(steps, {k: v for k, v in sorted(unmasked.items()) if v})


def timed_after_warm_up(llm: Any, prompts: dict[int, list[list[int]]], new_tokens: int, warm_tokens: int,
                        block: int) -> dict[int, Timed]:
    """``timed_steps`` per batch size, each after an untimed run of one block past the first: the first
    steps of a shape compile kernels and pick GEMM algorithms, which a median over a block's two commit
    steps would otherwise count."""
    for batch_prompts in prompts.values():
        timed_steps(llm, batch_prompts, warm_tokens + block, warm_tokens)
    return {b: timed_steps(llm, batch_prompts, new_tokens, warm_tokens) for b, batch_prompts in prompts.items()}


def first_block_outputs(prompt_len: int, block: int) -> int:
    """Outputs a request has once its first block is committed: the rest of the prompt's last block (a whole
    block after a prompt of whole blocks)."""
    return block - prompt_len % block


def _median_ms(steps: list[StepTime]) -> float:
    return statistics.median(s.seconds for s in steps) * 1e3


def _engine(folder: Path, args: argparse.Namespace, max_batch: int, max_len: int, **kwargs: Any) -> Any:
    from ...engine.llm import LLM

    page = RunnerConfig.page_size
    return LLM(model=str(folder), load_format="dummy", max_running_requests=max_batch,
               kv_cache_tokens=max_batch * (max_len + 2 * page) + page, max_context_len=max_len + page,
               chunked_prefill_size=max_batch * max_len,  # every prompt prefilled in one step: lockstep blocks
               enable_prefix_cache=False, **{**engine_kwargs(args), **kwargs})


def _release(device: torch.device) -> None:
    """The last engine goes before the next is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _row(block: int, batch: int, dllm: Timed, decode: Timed, head: dict[str, Any]) -> dict[str, Any]:
    steps = [s for s in dllm.steps if s.mode == "DLLM_EXTEND"]
    decodes = [s for s in decode.steps if s.mode == "DECODE"]
    step_ms, decode_ms = _median_ms(steps), _median_ms(decodes)
    by_tokens = {n: [s for s in steps if s.num_tokens == n] for n in sorted({s.num_tokens for s in steps})}
    in_block = _median_ms(by_tokens.get(batch * block, steps))
    first = _median_ms(by_tokens.get(2 * batch * block, steps))
    levels = committed_levels(block)
    flat = {c: batch * c * 1e3 / step_ms for c in levels}
    cycle = {c: batch * block * 1e3 / (first + (-(-block // c) - 1) * in_block) for c in levels}
    decode_tok_s = batch * 1e3 / decode_ms
    window_s = sum(s.seconds for s in steps)
    done = sum(n * k for n, k in dllm.unmasked.items())
    return {**head, "block_size": block, "batch_size": batch,
            "dllm_steps": len(steps), "decode_steps": len(decodes),
            "steady_steps_by_mode": dict(Counter(s.mode for s in dllm.steps)),
            "decode_steady_steps_by_mode": dict(Counter(s.mode for s in decode.steps)),
            "dllm_step_ms": round(step_ms, 3), "decode_step_ms": round(decode_ms, 3),
            "dllm_vs_decode": ratio(step_ms / decode_ms),
            "dllm_step_ms_by_tokens": {n: {"ms": round(_median_ms(s), 3), "steps": len(s)} for n, s in by_tokens.items()},
            "decode_tok_s": round(decode_tok_s, 1),
            "tok_s_at_committed": {c: round(v, 1) for c, v in flat.items()},
            "tok_s_at_committed_vs_decode": {c: ratio(v / decode_tok_s) for c, v in flat.items()},
            "tok_s_at_committed_with_commit_steps": {c: round(v, 1) for c, v in cycle.items()},
            "tok_s_at_committed_with_commit_steps_vs_decode": {c: ratio(v / decode_tok_s) for c, v in cycle.items()},
            "measured_tok_s": round(batch * block * head["blocks"] / window_s, 1),  # the timed blocks' tokens
            "dllm_unmasked_per_step": dllm.unmasked,
            "mean_committed_per_step": round(done / max(sum(dllm.unmasked.values()), 1), 3)}


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        raise ValueError("bench dllm times random weights: give --shape (a preset or a config.json), not --model")
    defaults = _device_defaults(args.device)
    shape = args.shape or defaults["shape"]
    base = config_file(shape) if shape.endswith(".json") else preset_config(shape)
    prompt_len = args.prompt_len or defaults["prompt_len"]
    mask = args.mask_token_id if args.mask_token_id is not None else base.get("mask_token_id", base["vocab_size"] - 1)
    max_batch, device = max(args.batch_sizes), torch.device(args.device)
    prompts = {b: random_prompts(min(mask, base["vocab_size"]), b, prompt_len, seed=b).tolist() for b in args.batch_sizes}
    head: dict[str, Any] = {"bench": "dllm", "device": device_name(device), "shape": shape,
                            "num_layers": base["num_hidden_layers"], "prompt_len": prompt_len, "blocks": args.blocks}
    with tempfile.TemporaryDirectory() as tmp:
        ar_folder = write_config_only(Path(tmp) / "qwen3", autoregressive_config(base))
        for block in args.block_sizes:
            warm = first_block_outputs(prompt_len, block)
            new = warm + block * args.blocks  # the first block (with the prompt's prefill), then the timed ones
            max_len = prompt_len + new + block
            folder = write_config_only(Path(tmp) / f"sdar-{block}", sdar_config(base, block, mask))
            # the steps its DLLM_EXTEND graphs do not take (prompts, a committed block beside the next) in pieces
            llm = _engine(folder, args, max_batch, max_len, attention_backend=dllm_backend(args),
                          enable_piecewise_cuda_graph=device.type == "cuda",
                          piecewise_cuda_graph_max_tokens=2 * max_batch * block)
            dllm = timed_after_warm_up(llm, prompts, new, warm, block)
            dtype, backend = str(llm.runner.dtype).removeprefix("torch."), llm.runner.attention_backend_name
            dllm_graphs, dllm_pieces = llm.runner.dllm_graphs is not None, llm.runner.piecewise is not None
            del llm
            _release(device)
            llm = _engine(ar_folder, args, max_batch, max_len, attention_backend=decode_backend(args))
            # the same context lengths: decode from the first block's end over as many tokens
            decode = timed_after_warm_up(llm, prompts, new, warm, block)
            ar_backend, graphs = llm.runner.attention_backend_name, llm.runner.graphs is not None
            del llm
            _release(device)
            for b in args.batch_sizes:
                yield _row(block, b, dllm[b], decode[b],
                           {**head, "dtype": dtype, "attention_backend": backend, "dllm_cuda_graph": dllm_graphs,
                            "dllm_piecewise_cuda_graph": dllm_pieces,
                            "decode_attention_backend": ar_backend, "decode_cuda_graph": graphs})
