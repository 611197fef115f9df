"""Paged extend (prefill) attention in Triton, for EXTEND and MIXED batches.

Request b has ``prefix_lens[b]`` tokens already cached and ``extend_lens[b]`` new ones, whose k/v
are written into the cache before the kernel runs, so all ``seq_len = prefix + extend`` keys are
read from the cache through ``req_to_token``. Queries are flat ([T, Hq, D]); request b's rows start
at ``qo_start[b]``. The query at position ``prefix + i`` sees keys at positions ``<= prefix + i``
and, with a sliding window W, ``> prefix + i - W``; block-causal (``block`` > 0, DLLM_EXTEND), it sees
every key up to the end of its block of ``block`` positions (blocks at multiples of it). A decode row of a MIXED batch is a request with
``extend_len`` 1. One program per (BLOCK_M query rows, query head, request), online softmax in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .attention_decode import LOG2E


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,  # q/out [T, Hq, D]; k/v cache [num_slots, Hkv, D]
    req_to_token_ptr, req_pool_ptr,  # [max_reqs, max_context] int64, [B]
    qo_start_ptr, prefix_lens_ptr, extend_lens_ptr,  # [B] int32 each (int64 read as int32 too)
    scale_log2, window, block,  # window <= 0: none; block > 0: block-causal
    stride_table, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    extend_len = tl.load(extend_lens_ptr + b).to(tl.int32)  # int32 or int64 lengths (a verify graph's)
    if m_block * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)
    qo_start = tl.load(qo_start_ptr + b).to(tl.int64)
    req = tl.load(req_pool_ptr + b).to(tl.int64)
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < extend_len
    mask_d = offs_d < HEAD_DIM
    q_pos = prefix_len + offs_m  # [BLOCK_M] positions of this block's queries
    q = tl.load(q_ptr + (qo_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # keys [lo, hi): hi past the block's last query (causal), lo at its first query's window start
    hi = tl.minimum(prefix_len + (m_block + 1) * BLOCK_M, prefix_len + extend_len)
    if block > 0:  # the last query's block may end past the tile
        hi = tl.minimum((hi - 1) // block * block + block, prefix_len + extend_len)
    lo = 0
    if window > 0:
        lo = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row = req_to_token_ptr + req * stride_table
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(row + offs_n, mask=mask_n, other=0)  # [BLOCK_N] int64
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if block > 0:
            visible = mask_n[None, :] & (offs_n[None, :] < (q_pos[:, None] // block + 1) * block)
        else:
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if window > 0:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # a row may see nothing in this tile (causal or window edge): keep its max finite, p = 0
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every real row sees at least its own key
    tl.store(out_ptr + (qo_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, qo_start: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, max_extend_len: int, scale: float,
                     sliding_window: int | None = None, block: int = 0) -> torch.Tensor:
    """q: [T, Hq, D], k/v_cache: [num_slots, Hkv, D], req_to_token: [max_reqs, max_context] int64,
    req_pool_indices: [B], qo_start/prefix_lens/extend_lens: [B] int32 (device),
    max_extend_len: max(extend_lens) (host); block > 0: block-causal -> out [T, Hq, D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads or q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("need num_heads a multiple of num_kv_heads and a contiguous head_dim")
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must have contiguous rows")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = req_pool_indices.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    # tiles and warps that sm_90 compiles without register spills (bf16)
    block_m, block_n, num_warps = (64, 64, 8) if head_dim <= 64 else (64, 32, 8) if head_dim <= 128 else (32, 16, 4)
    grid = (triton.cdiv(max_extend_len, block_m), num_heads, batch)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, req_to_token, req_pool_indices, qo_start, prefix_lens, extend_lens,
        scale * LOG2E, sliding_window or 0, block,
        req_to_token.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )
    return out
