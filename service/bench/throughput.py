"""Offline throughput on the GPU: N requests of fixed input/output lengths on random weights of a
named shape, all submitted at once; output tokens/s against the roofline time of the same work
(prefill FLOPs at the measured matmul rate + each decode step's bytes at the measured bandwidth)."""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch

from ...engine.sampling_params import SamplingParams
from .clocks import ClockSampler
from .batch import engine_kwargs, model_folder, random_prompts
from .limits import Roofline, device_name, measure_roofline, ratio, sync


def roofline_seconds(roof: Roofline, n: int, n_in: int, n_out: int, max_running: int, by_op: bool = False) -> float:
    """Lower bound on the time of the workload: prefill at the matmul rate, then waves of at most
    ``max_running`` requests decoding together, each step bounded by its bytes or its FLOPs (as one
    kernel, or with ``by_op`` as matmuls then attention: ``Roofline.decode_step_seconds_by_op``)."""
    step = roof.decode_step_seconds_by_op if by_op else roof.decode_step_seconds
    total = roof.prefill_flops([n_in] * n) / roof.flops
    for wave in range(0, n, max_running):
        rows = min(max_running, n - wave)
        total += sum(step([n_in + k] * rows) for k in range(1, n_out))
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ...engine.llm import LLM

    device = torch.device(args.device)
    tmp = tempfile.TemporaryDirectory()
    folder, load_format = model_folder(args, tmp.name)
    n, n_in, n_out, running = args.num_prompts, args.input_len, args.output_len, args.max_running_requests
    llm = LLM(model=folder, load_format=load_format, **engine_kwargs(args),
              max_running_requests=running, chunked_prefill_size=args.max_prefill_tokens,
              kv_cache_tokens=running * (n_in + n_out + 16) + 64, max_context_len=n_in + n_out + 16,
              enable_mixed=args.enable_mixed)
    mc = llm.model_config
    prompts = random_prompts(mc.vocab_size, n, n_in)
    sp = SamplingParams(temperature=0.0, max_new_tokens=n_out, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2, :16].tolist(), sampling_params=sp.replace(max_new_tokens=8))
    sync(device)
    with ClockSampler(device) as clocks:
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts.tolist(), sampling_params=sp)
        sync(device)
        seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == n_out for o in outs)
    runner = llm.runner
    roof = measure_roofline(runner)
    limit = roofline_seconds(roof, n, n_in, n_out, running)
    out: dict[str, Any] = {
        "bench": "throughput", "shape": args.model or args.shape, "device": device_name(device),
        "num_prompts": n, "input_len": n_in, "output_len": n_out, "max_running_requests": running,
        "attention_backend": runner.attention_backend_name, "seconds": round(seconds, 3),
        "output_tokens_per_s": round(n * n_out / seconds, 1),
        "total_tokens_per_s": round(n * (n_in + n_out) / seconds, 1),
        "roofline_seconds": round(limit, 3), "roofline_ratio": ratio(limit / seconds),
        "op_roofline_ratio": ratio(roofline_seconds(roof, n, n_in, n_out, running, by_op=True) / seconds),
        "measured_copy_bandwidth_tb_s": round(roof.bandwidth / 1e12, 3),
        "measured_bf16_tflops": round(roof.flops / 1e12, 1),
        "gpu_clocks": clocks.summary,  # SM clock and power during the timed run (nvidia-smi)
        "steps_by_mode": llm.stats()["mode_distribution"],
    }
    if args.baseline == "transformers":
        from .baseline import transformers_throughput

        dtype = runner.dtype
        del llm, runner
        torch.cuda.empty_cache()
        k = min(args.baseline_num_prompts, n)
        base = transformers_throughput(folder, prompts[:k].to(device), n_out, dtype, args.baseline_batch_size)
        out["transformers"] = base
        out["speedup_vs_transformers"] = round(out["output_tokens_per_s"] / base["output_tokens_per_s"], 2)
    tmp.cleanup()
    return out
