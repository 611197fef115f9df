"""Single-batch latency on random weights of a named shape: prefill time and decode step time,
each against its physical limit measured in the same run (bf16 matmul rate for prefill FLOPs,
device-copy bandwidth for the bytes of weights + KV one decode step reads)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from modeserve.engine.sampling_params import SamplingParams


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Bytes/s of a device-to-device copy (read + write both counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, n = time.perf_counter(), 10
    for _ in range(n):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * nbytes * n / (time.perf_counter() - start)


def matmul_rate(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of a large bf16 matmul."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from modeserve.engine.llm import LLM
    from modeserve.engine.models.random_checkpoint import write_random_checkpoint

    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(write_random_checkpoint(Path(tmp.name) / "m", args.shape, dtype=torch.bfloat16))
    llm = LLM(model=model, device=args.device, dtype=args.dtype, page_size=16,
              max_running_requests=max(args.batch_size, 1), chunked_prefill_size=args.batch_size * args.input_len,
              disable_cuda_graph=args.disable_cuda_graph,
              kv_cache_tokens=args.batch_size * (args.input_len + args.output_len) + 64)
    device = torch.device(args.device)
    mc = llm.model_config
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.output_len, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, mc.vocab_size, (args.input_len,), generator=g).tolist() for _ in range(args.batch_size)]
    llm.generate(prompt_token_ids=prompts, sampling_params=sp.replace(max_new_tokens=4))  # warm-up
    reqs = [llm.make_request(p, sp) for p in prompts]
    for r in reqs:
        llm.add_request(r)
    times: dict[str, list[float]] = {"EXTEND": [], "DECODE": []}
    while not all(r.finished for r in reqs):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        step = llm.scheduler.schedule()
        assert step is not None
        result = llm.runner.forward(step.batch)
        torch.cuda.synchronize(device)
        times.setdefault(step.batch.forward_mode.name, []).append(time.perf_counter() - start)
        llm.scheduler.process_result(step, result)
    params = sum(p.numel() for p in llm.runner.model.parameters())
    weight_bytes = params * llm.runner.dtype.itemsize
    kv_bytes_per_token = llm.runner.kv_cache.bytes_per_token
    mean_ctx = args.input_len + args.output_len / 2
    decode_bytes = weight_bytes + args.batch_size * mean_ctx * kv_bytes_per_token
    bw, flops = copy_bandwidth(device), matmul_rate(device)
    decode_s = statistics.median(times["DECODE"])
    prefill_s = sum(times["EXTEND"])
    prefill_flops = 2 * (params - mc.vocab_size * mc.hidden_size) * args.batch_size * args.input_len
    tmp.cleanup()
    return {
        "bench": "latency", "shape": args.model or args.shape, "device": torch.cuda.get_device_name(device),
        "dtype": args.dtype, "batch_size": args.batch_size, "input_len": args.input_len,
        "output_len": args.output_len, "cuda_graph": llm.runner.graphs is not None,
        "attention_backend": llm.runner.attention_backend_name,
        "decode_step_ms": round(decode_s * 1e3, 4),
        "decode_tokens_per_s": round(args.batch_size / decode_s, 1),
        "decode_roofline_ms": round(decode_bytes / bw * 1e3, 4),
        "decode_roofline_ratio": round(decode_bytes / bw / decode_s, 3),
        "prefill_ms": round(prefill_s * 1e3, 3),
        "prefill_tflops": round(prefill_flops / prefill_s / 1e12, 1),
        "prefill_matmul_ratio": round(prefill_flops / prefill_s / flops, 3),
        "measured_copy_bandwidth_tb_s": round(bw / 1e12, 3), "measured_bf16_tflops": round(flops / 1e12, 1),
        "weight_bytes": weight_bytes, "graph_stats": llm.runner.graphs.stats() if llm.runner.graphs else None,
    }
