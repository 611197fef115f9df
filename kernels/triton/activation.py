"""SiLU-and-mul as a Triton kernel (same contract as ``kernels.ops.silu_and_mul``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride_t, out_stride_t, I, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    row = x_ptr + t * x_stride_t
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + I + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + t * out_stride_t + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] = [gate | up] -> silu(gate) * up: [T, I], computed in fp32, in x's dtype.

    One program per (row, block of up to 1024 columns): a single decode row still spreads over
    the device when I is large. Rows may have any stride.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} of silu_and_mul input must be even ([gate | up])")
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, x.shape[-1])  # a view for [T, 2I] with any row stride
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out2 = out.view(-1, inter)
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=block, num_warps=max(1, block // 256),
        **pdl_args(x.device),
    )
    return out
