"""RMSNorm and fused residual-add + RMSNorm as Triton kernels (same contract as ``kernels.ops``).

One program per row: a row is a token of ``[T, H]`` or a (token, head) of ``[T, heads, D]``, so
q/k views of a fused qkv tensor are normalised in place of a copy (any row and head stride, last
dim contiguous).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue


@triton.jit
def _normalize(xf, w_ptr, cols, mask, D, eps, x_dtype: tl.constexpr):
    """fp32 row -> (x * rsqrt(mean(x^2) + eps)) rounded to x's dtype, times the weight (fp32)."""
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * rstd).to(x_dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return normed * w


@triton.jit
def _load_row(x_ptr, x_stride_t, x_stride_h, D, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Both kernels' start: the PDL prologue, then this program's row of x (in x's dtype, 0 past D), its
    token and head, and its columns with their mask."""
    pdl_prologue(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + t * x_stride_t + h * x_stride_h + cols, mask=mask, other=0.0)
    return x, t, h, cols, mask


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    x_stride_t, x_stride_h, out_stride_t, out_stride_h,
    D, eps,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    x, t, h, cols, mask = _load_row(x_ptr, x_stride_t, x_stride_h, D, BLOCK, USE_PDL)
    out = _normalize(x.to(tl.float32), w_ptr, cols, mask, D, eps, x.dtype)
    tl.store(out_ptr + t * out_stride_t + h * out_stride_h + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr,
    x_stride_t, x_stride_h, r_stride_t, r_stride_h, out_stride_t, out_stride_h,
    D, eps,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    x, t, h, cols, mask = _load_row(x_ptr, x_stride_t, x_stride_h, D, BLOCK, USE_PDL)
    r = tl.load(r_ptr + t * r_stride_t + h * r_stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    res_dtype = r_out_ptr.dtype.element_ty
    res = (x.to(tl.float32) + r).to(res_dtype)  # the sum is rounded before it is normalised, as in the reference
    out_offs = t * out_stride_t + h * out_stride_h + cols
    tl.store(r_out_ptr + out_offs, res, mask=mask)
    out = _normalize(res.to(tl.float32), w_ptr, cols, mask, D, eps, res_dtype)
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] or [T, heads, D] (normalised over the last dim), weight: [last dim] -> x's shape.

    Output dtype is that of ``weight * x`` (x's dtype when the weight has it), as in the reference.
    """
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.numel() == 0:
        return out
    x3, out3 = _rows(x), _rows(out)
    block = triton.next_power_of_2(x3.shape[-1])
    _rms_norm_kernel[(x3.shape[0], x3.shape[1])](
        x3, weight.contiguous(), out3,
        x3.stride(0), x3.stride(1), out3.stride(0), out3.stride(1),
        x3.shape[-1], eps,
        BLOCK=block, num_warps=_num_warps(block), **pdl_args(x.device),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] (or [T, heads, D]) -> (rms_norm(x + residual), x + residual), one pass."""
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    res_dtype = torch.promote_types(x.dtype, residual.dtype)
    new_residual = torch.empty(x.shape, dtype=res_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(res_dtype, weight.dtype), device=x.device)
    if x.numel() == 0:
        return out, new_residual
    x3, r3 = _rows(x), _rows(residual)
    out3, r_out3 = out.view(x3.shape), new_residual.view(x3.shape)
    block = triton.next_power_of_2(x3.shape[-1])
    _add_rms_norm_kernel[(x3.shape[0], x3.shape[1])](
        x3, r3, weight.contiguous(), out3, r_out3,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), out3.stride(0), out3.stride(1),
        x3.shape[-1], eps,
        BLOCK=block, num_warps=_num_warps(block), **pdl_args(x.device),
    )
    return out, new_residual


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A [rows, heads, D] view of x (D contiguous); copies only when no such view exists."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(-1, 1, x.shape[-1])


def _num_warps(block: int) -> int:
    return max(1, min(8, block // 256))
