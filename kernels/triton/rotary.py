"""Rotary embedding and KV-cache stores as Triton kernels.

``apply_rotary`` has the contract of ``kernels.ops.apply_rotary``; ``store_kv`` that of
``KVCache.write`` on one layer's tensors; ``apply_rotary_and_store_kv`` is the two in one launch. Both take q/k/v as views of a fused qkv tensor (any
token and head stride, head dim contiguous) and run one program per token over all its heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round an fp32 value to dtype and back: one op of the reference, which runs in dtype."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(
    src, dst, src_stride_h, dst_stride_h, num_heads, cos, sin, HALF,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One token's heads [num_heads, 2 * HALF]: neox rotate-half, rounded op by op in src's dtype like
    the reference, then cast to dst's dtype."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    src_offs = heads * src_stride_h + cols
    x1 = tl.load(src + src_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + src_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = src.dtype.element_ty
    c = _round(cos, dtype)[None, :]  # the reference casts cos/sin to q's dtype first
    s = _round(sin, dtype)[None, :]
    # out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2 | x1]
    out1 = _round(x1 * c, dtype) - _round(x2 * s, dtype)
    out2 = _round(x2 * c, dtype) + _round(x1 * s, dtype)
    dst_offs = heads * dst_stride_h + cols
    tl.store(dst + dst_offs, out1.to(dtype).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + dst_offs + HALF, out2.to(dtype).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(src, dst, src_stride_h, dst_stride_h, num_heads, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's heads [num_heads, D], cast to dst's dtype."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (cols < D)
    x = tl.load(src + heads * src_stride_h + cols, mask=mask)
    tl.store(dst + heads * dst_stride_h + cols, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_sin_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr,  # used with STORE: rotated k and v go to the cache too
    q_stride_t, q_stride_h, k_stride_t, k_stride_h,
    q_out_stride_t, q_out_stride_h, k_out_stride_t, k_out_stride_h, cos_sin_stride,
    v_stride_t, v_stride_h, cache_stride_s, cache_stride_h,
    num_q_heads, num_kv_heads, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, STORE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * cos_sin_stride
    cos = tl.load(row + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + t * q_stride_t, q_out_ptr + t * q_out_stride_t, q_stride_h, q_out_stride_h,
        num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr + t * k_stride_t, k_out_ptr + t * k_out_stride_t, k_stride_h, k_out_stride_h,
        num_kv_heads, cos, sin, HALF, BLOCK_HKV, BLOCK_HALF,
    )
    if STORE:
        slot = tl.load(loc_ptr + t).to(tl.int64)
        _rotate_heads(
            k_ptr + t * k_stride_t, k_cache_ptr + slot * cache_stride_s, k_stride_h, cache_stride_h,
            num_kv_heads, cos, sin, HALF, BLOCK_HKV, BLOCK_HALF,
        )
        _copy_heads(v_ptr + t * v_stride_t, v_cache_ptr + slot * cache_stride_s, v_stride_h, cache_stride_h,
                    num_kv_heads, 2 * HALF, BLOCK_HKV, 2 * BLOCK_HALF)


@triton.jit
def _store_kv_kernel(
    k_cache_ptr, v_cache_ptr, loc_ptr, k_ptr, v_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h, cache_stride_s, cache_stride_h,
    num_heads, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (cols < D)
    dst = slot * cache_stride_s + heads * cache_stride_h + cols
    k = tl.load(k_ptr + t * k_stride_t + heads * k_stride_h + cols, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + heads * v_stride_h + cols, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary. q: [T, Hq, D], k: [T, Hkv, D] (same dtype), positions: [T] (int),
    cos_sin: [max_pos, D] = [cos | sin] (float32) -> new contiguous (q, k), bit-equal to the reference.

    Positions are not range-checked (that would sync the host).
    """
    return _rotary(q, k, positions, cos_sin, None)


def apply_rotary_and_store_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` and ``store_kv`` of the rotated k and of v in one kernel: one launch per layer
    instead of two. Returns the rotated (q, k)."""
    _check_cache(k_cache, v_cache, k, v, loc)
    return _rotary(q, k, positions, cos_sin, (v, k_cache, v_cache, loc))


def _rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D] with equal T and D")
    if q.dtype != k.dtype:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) must share a dtype")
    head_dim = q.shape[-1]
    if head_dim % 2 or cos_sin.shape[-1] != head_dim:
        raise ValueError(f"head_dim {head_dim} must be even and match cos_sin {tuple(cos_sin.shape)}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0] == 0:
        return q_out, k_out
    q, k, cos_sin = _last_contiguous(q), _last_contiguous(k), _last_contiguous(cos_sin)
    if store is None:  # the kernel never reads these
        v, k_cache, v_cache, loc = k, k_out, k_out, positions
    else:
        v, k_cache, v_cache, loc = store
        v = _last_contiguous(v)
    half = head_dim // 2
    _rotary_kernel[(q.shape[0],)](
        q, k, q_out, k_out, positions.contiguous(), cos_sin, v, k_cache, v_cache, loc.contiguous(),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin.stride(0),
        v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        q.shape[1], k.shape[1], half,
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]), BLOCK_HKV=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half), STORE=store is not None,
        num_warps=max(1, min(8, triton.next_power_of_2(q.shape[1] * half) // 256)),
        enable_fp_fusion=False,  # no fma: each product is rounded to q's dtype, as in the reference
        **pdl_args(q.device),
    )
    return q_out, k_out


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write k, v: [T, Hkv, D] into k_cache, v_cache: [num_slots, Hkv, D] at slots loc: [T] (int).

    Values are cast to the cache dtype. Slots are not range-checked (that would sync the host);
    a repeated slot gets one of its rows, as with ``index_copy_``.
    """
    _check_cache(k_cache, v_cache, k, v, loc)
    if k.shape[0] == 0:
        return
    k, v = _last_contiguous(k), _last_contiguous(v)
    num_heads, head_dim = k.shape[1], k.shape[2]
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(k.shape[0],)](
        k_cache, v_cache, loc.contiguous(), k, v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        num_heads, head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=max(1, min(8, block_h * block_d // 256)), **pdl_args(k.device),
    )


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 loc: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.stride(-1) != 1:
        raise ValueError("the caches' head dim must be contiguous")
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[1:] or loc.shape != k.shape[:1]:
        raise ValueError(f"k/v {tuple(k.shape)}, {tuple(v.shape)} do not fit the cache "
                         f"{tuple(k_cache.shape)} at loc {tuple(loc.shape)}")


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
