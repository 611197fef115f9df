"""Which implementation of the decoder's elementwise ops a model calls: the torch references
(``kernels.ops``) or the fused Triton kernels (``kernels.triton.ops``), same signatures."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from . import accept, chain_verify, ops, sampling

KERNEL_BACKENDS = ("auto", "torch", "triton")
SMALL_GEMM_MAX_ROWS = 64  # KernelOps.small_gemm's most rows (more: cuBLAS, the weights' reads no longer the whole cost)


@dataclass(frozen=True)
class KernelOps:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    store_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    apply_rotary_and_store_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    argmax: Callable[..., torch.Tensor]  # (x, into=None, at=None)
    record_tokens: Callable[..., None]
    chain_verify_rows: Callable[..., None]  # chained TARGET_VERIFY rows resolved (kernels.chain_verify)
    accept_runs: Callable[..., torch.Tensor]  # a verify step's greedy acceptance (kernels.accept)
    sample_sorted: sampling.SampleSorted  # the sampling step after the sort: filters + seeded Gumbel-max
    # one-row linear layers: a GEMV kernel, and how to time it against cuBLAS (None: always cuBLAS)
    gemv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    gemv_timer: Callable[[torch.Tensor, torch.Tensor | None], tuple[bool, float, float]] | None = None
    # the GEMV with an add+norm epilogue: add_rms_norm(gemv(x, w, b), residual, norm weight, eps)
    gemv_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # linear layers of a few rows without thread-block clusters, and its tuning before graph capture
    # (weight, bias, max rows); RunnerConfig.small_batch_gemm
    small_gemm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    small_gemm_prepare: Callable[[torch.Tensor, torch.Tensor | None, int], None] | None = None


TORCH_OPS = KernelOps("torch", ops.rms_norm, ops.add_rms_norm, ops.silu_and_mul, ops.store_kv,
                      ops.apply_rotary_and_store_kv, ops.argmax, ops.record_tokens, chain_verify.chain_verify_rows,
                      accept.accept_runs, sampling.sample_sorted)


def resolve_kernel_backend(name: str, device: torch.device) -> str:
    """``auto``: Triton on CUDA when installed, else the torch references."""
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {KERNEL_BACKENDS}")
    if name == "auto":
        return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
    return name


def kernel_ops(name: str, device: torch.device) -> KernelOps:
    if resolve_kernel_backend(name, device) == "torch":
        return TORCH_OPS
    # Triton only when chosen: it may be absent, and a CPU engine must not pay for importing it
    from .triton import ops as triton_ops
    from .triton.accept import accept_runs
    from .triton.argmax import argmax
    from .triton.chain_verify import chain_verify_rows
    from .triton.gemv import gemv, gemv_add_rms_norm, gemv_keeps_up
    from .triton.rotary import store_kv
    from .triton.sampling import sample_sorted
    from .triton.slots import record_tokens
    from .triton.small_gemm import prepare_small_gemm, small_gemm

    return KernelOps("triton", triton_ops.rms_norm, triton_ops.add_rms_norm, triton_ops.silu_and_mul,
                     store_kv, triton_ops.apply_rotary_and_store_kv, argmax, record_tokens, chain_verify_rows,
                     accept_runs, sample_sorted, gemv, gemv_keeps_up, gemv_add_rms_norm, small_gemm,
                     prepare_small_gemm)
