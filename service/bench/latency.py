"""Single-batch latency on random weights of a named shape: prefill time and decode step time,
each against its physical limit measured in the same run (bf16 matmul rate for prefill FLOPs,
device-copy bandwidth for the bytes of weights + KV one decode step reads), and optionally the
same batch through ``transformers``.

The decode step is measured the way the engine serves: steps launched back to back with one in
flight (``LLM.run_until``), so the figure includes every host cost the device cannot hide."""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch

from ...engine.sampling_params import SamplingParams
from .batch import add_batch, engine_kwargs, model_folder, prefill, random_prompts
from .clocks import ClockSampler
from .limits import device_name, measure_roofline, ratio, sync
from .profile import decode_profile, prefill_profile


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ...engine.llm import LLM

    device = torch.device(args.device)
    tmp = tempfile.TemporaryDirectory()
    folder, load_format = model_folder(args, tmp.name)
    bs, n_in, n_out = args.batch_size, args.input_len, args.output_len
    llm = LLM(model=folder, load_format=load_format, **engine_kwargs(args), page_size=16,
              max_running_requests=bs, chunked_prefill_size=min(bs * n_in, args.max_prefill_tokens),
              kv_cache_tokens=bs * (n_in + n_out) + 16 * bs + 64, max_context_len=n_in + n_out + 16)
    mc, runner = llm.model_config, llm.runner
    prompts = random_prompts(mc.vocab_size, bs, n_in)
    sp = SamplingParams(temperature=0.0, max_new_tokens=n_out, ignore_eos=True)
    # warm-up on other prompts of the same shape (no prefix-cache hits later): first-use costs stay out
    llm.generate(prompt_token_ids=random_prompts(mc.vocab_size, bs, n_in, seed=1).tolist(),
                 sampling_params=sp.replace(max_new_tokens=8))
    reqs = add_batch(llm, prompts.tolist(), sp)
    sync(device)
    start = time.perf_counter()
    prefill(llm, reqs)  # chunked if longer than max_prefill_tokens
    sync(device)
    prefill_s = time.perf_counter() - start
    with ClockSampler(device) as clocks:
        start = time.perf_counter()
        llm.run_until(lambda: all(r.finished for r in reqs))
        sync(device)
        decode_s = (time.perf_counter() - start) / max(n_out - 1, 1)
    profiles = None
    if args.profile_steps:
        profiles = {"decode_profile": decode_profile(llm, prompts, sp, args.profile_steps),
                    "prefill_profile": prefill_profile(llm, prompts, sp)}

    roof = measure_roofline(runner)
    mean_ctx = n_in + n_out / 2
    decode_limit = roof.decode_step_seconds([int(mean_ctx)] * bs)
    prefill_flops = roof.prefill_flops([n_in] * bs)
    out: dict[str, Any] = {
        "bench": "latency", "shape": args.model or args.shape, "device": device_name(device),
        "dtype": str(runner.dtype).removeprefix("torch."), "batch_size": bs, "input_len": n_in, "output_len": n_out,
        "attention_backend": runner.attention_backend_name, "cuda_graph": runner.graphs is not None,
        "decode_step_ms": round(decode_s * 1e3, 4),
        "decode_tokens_per_s": round(bs / decode_s, 1),
        "decode_roofline_ms": round(decode_limit * 1e3, 4),
        "decode_roofline_ratio": ratio(decode_limit / decode_s),
        "decode_op_roofline_ratio": ratio(roof.decode_step_seconds_by_op([int(mean_ctx)] * bs) / decode_s),
        "decode_step_bytes": int(roof.decode_step_bytes([int(mean_ctx)] * bs)),
        "prefill_ms": round(prefill_s * 1e3, 3),
        "prefill_tflops": round(prefill_flops / prefill_s / 1e12, 1),
        "prefill_matmul_ratio": ratio(prefill_flops / prefill_s / roof.flops),
        "measured_copy_bandwidth_tb_s": round(roof.bandwidth / 1e12, 3),
        "measured_bf16_tflops": round(roof.flops / 1e12, 1),
        "gpu_clocks_decode": clocks.summary,  # SM clock and power during the decode steps (nvidia-smi)
        "graph_stats": runner.graphs.stats() if runner.graphs else None,
        "piecewise_graph_stats": runner.piecewise.stats() if runner.piecewise else None,
        "one_row_linear": runner.gemv_report,  # per weight shape: GEMV kernel vs cuBLAS at batch 1, µs
    }
    if device.type == "cuda" and bs > 1:
        from .linear import linear_report

        out["linear_at_batch"] = linear_report(runner.model, bs, roof.bandwidth, roof.flops)
    if profiles is not None:
        out.update(profiles)
    if args.baseline == "transformers":
        from .baseline import transformers_latency

        dtype = runner.dtype
        del llm, runner
        torch.cuda.empty_cache()
        base = transformers_latency(folder, prompts.to(device), args.baseline_output_len, dtype)
        out["transformers"] = base
        out["decode_speedup_vs_transformers"] = round(base["decode_step_ms"] / out["decode_step_ms"], 2)
        out["prefill_speedup_vs_transformers"] = round(base["prefill_ms"] / out["prefill_ms"], 2)
    tmp.cleanup()
    return out
