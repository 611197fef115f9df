"""Decode attention alone, as the engine runs it (KV store + attention, captured in a CUDA graph over
``--layers`` layers and replayed), for each backend and batch size, against the bytes of K and V the
step must read at the device-copy bandwidth measured in the same run."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

from ...engine.forward_mode import ForwardMode
from ...kernels.attention.base import AttentionBackend, AttentionInputs, GraphInputs
from ...kernels.attention.kv_cache import KVCache
from ...kernels.graph_timing import graph_replay_seconds
from ...kernels.triton.attention_decode import DecodeTiles
from .limits import copy_bandwidth, device_name

# FlashInfer with its decode kernel forced either way or by the default rule; triton, or
# triton@SPLITS[:BLOCK_N[:WARPS[:STAGES]]]: decode splits per (request, kv head) and the kernel's launch
# shape instead of the defaults. With only SPLITS the shape is the engine's (default_decode_tiles, by
# splits); once any shape part is given, an empty one keeps DecodeTiles' field default: triton@:64:8:2
BACKENDS = ("flashinfer", "flashinfer-tensor-cores", "flashinfer-cuda-cores", "triton",
            "triton@SPLITS[:BLOCK_N[:WARPS[:STAGES]]]", "torch")


def parse_triton_variant(name: str) -> tuple[int | None, DecodeTiles | None]:
    """``triton`` or ``triton@SPLITS[:BLOCK_N[:WARPS[:STAGES]]]`` -> (splits, tiles); None: the default."""
    spec = name.removeprefix("triton").removeprefix("@")
    parts = spec.split(":") if spec else []
    if len(parts) > 4 or not all(p == "" or p.isdigit() for p in parts):
        raise ValueError(f"{name!r}: want triton@SPLITS[:BLOCK_N[:WARPS[:STAGES]]] with integers")
    splits, block_n, warps, stages = [int(p) if p else None for p in parts] + [None] * (4 - len(parts))
    if splits == 0:
        raise ValueError(f"{name!r}: splits must be at least 1")
    given = {k: v for k, v in (("block_n", block_n), ("num_warps", warps), ("num_stages", stages)) if v is not None}
    return splits, DecodeTiles(**given) if given else None


def make_backend(name: str, kv: KVCache, num_heads: int) -> AttentionBackend:
    scale = kv.head_dim ** -0.5
    if name.startswith("flashinfer"):
        from ...kernels.attention.flashinfer_backend import FlashInferAttentionBackend

        tensor_cores = {"flashinfer": None, "flashinfer-tensor-cores": True, "flashinfer-cuda-cores": False}[name]
        return FlashInferAttentionBackend(kv, num_heads, scale, None, decode_tensor_cores=tensor_cores)
    if name == "triton" or name.startswith("triton@"):
        from ...kernels.attention.triton_backend import TritonAttentionBackend

        splits, tiles = parse_triton_variant(name)
        return TritonAttentionBackend(kv, num_heads, scale, None, num_kv_splits=splits, decode_tiles=tiles)
    if name == "torch":
        from ...kernels.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv, num_heads, scale, None)
    raise ValueError(f"unknown backend {name!r}; choose from {BACKENDS}")


def decode_inputs(bs: int, context: int, page_size: int, device: torch.device, dtype: torch.dtype) -> AttentionInputs:
    """``bs`` requests of ``context`` tokens (the last one being written now), each on its own pages
    after the reserved page 0."""
    pages = -(-context // page_size)
    page_of = 1 + np.arange(bs * pages, dtype=np.int32).reshape(bs, pages)  # [bs, pages]
    slots = (page_of[:, :, None].astype(np.int64) * page_size + np.arange(page_size)).reshape(bs, -1)
    req_to_token = torch.from_numpy(slots).to(device)
    return AttentionInputs(
        forward_mode=ForwardMode.DECODE, req_pool_indices=torch.arange(bs, device=device),
        prefix_lens_cpu=[context - 1] * bs, extend_lens_cpu=[1] * bs,
        seq_lens=torch.full((bs,), context, dtype=torch.int64, device=device),
        out_cache_loc=req_to_token[:, context - 1].contiguous(), req_to_token=req_to_token, dtype=dtype,
        req_pool_indices_cpu=np.arange(bs, dtype=np.int64), req_to_page_cpu=page_of)


def time_backend(name: str, args: argparse.Namespace, bs: int, device: torch.device) -> float:
    """Seconds per layer of the replayed graph."""
    dtype = getattr(torch, args.dtype)
    pages = -(-args.context_len // args.page_size)
    kv = KVCache(args.layers, args.page_size * (1 + bs * pages), args.num_kv_heads, args.head_dim, args.page_size,
                 dtype, device)
    for t in kv.k + kv.v:
        t.normal_()
    backend = make_backend(name, kv, args.num_heads)
    inputs = decode_inputs(bs, args.context_len, args.page_size, device, dtype)
    q = torch.randn(bs, args.num_heads, args.head_dim, dtype=dtype, device=device)
    k = torch.randn(bs, args.num_kv_heads, args.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    static = GraphInputs(inputs.out_cache_loc, inputs.req_pool_indices, inputs.seq_lens,  # every row real
                         inputs.req_to_token)
    backend.init_capture(bs, static)
    for layer in range(args.layers):  # warm-up outside the graph (JIT, autotuning)
        backend.forward(q, k, v, layer)
    layers = lambda: [backend.forward(q, k, v, layer) for layer in range(args.layers)]  # noqa: E731
    replay_setup = lambda: backend.init_replay(inputs, bs)  # noqa: E731  (FlashInfer plans)
    return graph_replay_seconds(layers, args.repeats, warmup=3, after_capture=replay_setup) / args.layers


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    itemsize = getattr(torch, args.dtype).itemsize
    rows = []
    for bs in args.batch_sizes:
        kv_bytes = 2 * bs * args.context_len * args.num_kv_heads * args.head_dim * itemsize  # per layer
        row: dict[str, Any] = {"batch_size": bs, "kv_bytes_per_layer": kv_bytes,
                               "roofline_us_per_layer": round(kv_bytes / bandwidth * 1e6, 2)}
        for name in args.backends:
            seconds = time_backend(name, args, bs, device)
            row[name] = {"us_per_layer": round(seconds * 1e6, 2),
                         "roofline_ratio": round(kv_bytes / bandwidth / seconds, 3)}
        rows.append(row)
    return {"bench": "attention", "device": device_name(device), "dtype": args.dtype, "num_heads": args.num_heads,
            "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim, "page_size": args.page_size,
            "context_len": args.context_len, "measured_copy_bandwidth_tb_s": round(bandwidth / 1e12, 3),
            "by_batch_size": rows}
