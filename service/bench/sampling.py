"""The sampling step on the device, as the engine runs it (captured in a CUDA graph and replayed):
``sample()`` whole (temperature, sort, filters, seeded draw) with the step after the sort done by the
torch reference or by the fused Triton kernel, and that step alone against the bytes it must read
(every sorted logit, and the ids of the ranks the filters keep) at the device-copy bandwidth measured
in the same run."""

from __future__ import annotations

import argparse
import functools
from typing import Any, Callable

import torch

from ...engine.runner.sampler import SamplingTensors, sample
from ...kernels import sampling
from ...kernels.graph_timing import graph_replay_seconds
from .limits import copy_bandwidth, device_name


def sampling_tensors(args: argparse.Namespace, bs: int, device: torch.device, g: torch.Generator) -> SamplingTensors:
    full = lambda value, dtype: torch.full((bs,), value, dtype=dtype, device=device)  # noqa: E731
    return SamplingTensors(
        temperatures=full(args.temperature, torch.float32), top_ps=full(args.top_p, torch.float32),
        top_ks=full(args.top_k, torch.int64), min_ps=full(args.min_p, torch.float32),
        seeds=torch.randint(-(2**62), 2**62, (bs,), generator=g, device=device),
        positions=torch.randint(0, 4096, (bs,), generator=g, device=device),
        frequency_penalties=full(0.0, torch.float32), presence_penalties=full(0.0, torch.float32),
        repetition_penalties=full(1.0, torch.float32), any_penalties=False, all_greedy=False, max_top_n=0)


def timed(body: Callable[[], object], repeats: int) -> float:
    """Seconds per call of ``body`` replayed from a CUDA graph (run once outside first)."""
    body()
    return graph_replay_seconds(body, repeats, warmup=3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.temperature <= 0:
        raise ValueError("--temperature must be > 0 (greedy rows skip the sampling step)")
    from ...kernels.triton.sampling import sample_sorted as fused

    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    impls = {"torch": sampling.sample_sorted, "fused": fused}
    rows = []
    for bs in args.batch_sizes:
        g = torch.Generator(device=device).manual_seed(bs)
        logits = torch.randn(bs, args.vocab, generator=g, device=device) * args.logit_scale
        st = sampling_tensors(args, bs, device, g)
        sorted_logits, sorted_ids = torch.sort(logits / args.temperature, dim=-1, descending=True)
        after = (sorted_logits, sorted_ids, st.top_ks, st.top_ps, st.min_ps, st.seeds, st.positions)
        tokens = {name: fn(*after) for name, fn in impls.items()}
        # the least the step must read: every logit (the softmax's denominator) and the ids of the ranks
        # the filters keep (a prefix of each row), the only ones that can be drawn
        kept = int(sampling.keep_mask_sorted(sorted_logits, st.top_ks, st.top_ps, st.min_ps).sum())
        in_bytes = bs * args.vocab * sorted_logits.element_size() + kept * sorted_ids.element_size()
        row: dict[str, Any] = {
            "batch_size": bs, "same_tokens": bool(torch.equal(tokens["torch"], tokens["fused"])),
            "kept_ranks": kept,
            "after_sort_bytes": in_bytes, "after_sort_roofline_us": round(in_bytes / bandwidth * 1e6, 2),
            "sort_us": round(timed(lambda: torch.sort(logits, dim=-1, descending=True), args.repeats) * 1e6, 2)}
        for name, fn in impls.items():
            after_s = timed(functools.partial(fn, *after), args.repeats)
            whole_s = timed(functools.partial(sample, logits, st, fn), args.repeats)
            row[name] = {"sample_us": round(whole_s * 1e6, 2), "after_sort_us": round(after_s * 1e6, 2),
                         "after_sort_roofline_ratio": round(in_bytes / bandwidth / after_s, 3)}
        row["after_sort_speedup"] = round(row["torch"]["after_sort_us"] / row["fused"]["after_sort_us"], 2)
        row["sample_speedup"] = round(row["torch"]["sample_us"] / row["fused"]["sample_us"], 2)
        rows.append(row)
    return {"bench": "sampling", "device": device_name(device), "vocab": args.vocab, "temperature": args.temperature,
            "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "measured_copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "by_batch_size": rows}
