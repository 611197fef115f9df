"""Paged decode attention in Triton: one query token per request, split-K (flash decoding).

Request b's keys are the KV slots ``req_to_token[req_pool_indices[b], 0:seq_lens[b]]`` (token-level
indirection, so any page size works). Stage 1 runs one program per (request, kv head, split): it
attends all query heads of that kv head (GQA) to one slice of the keys, with online softmax in fp32,
and writes the slice's normalised output and log-sum-exp. The slices are merged per query head by
the program of each (request, kv head) that finishes last: every program counts itself in on a
device counter after its slice is written (an acq_rel atomic after a CTA barrier, so the slice is
visible before the count), and the one that sees the others all in reads the slices back past L1,
merges them, writes the output and resets the counter to 0 for the next launch. A separate merge
kernel per layer cost a launch and a dependency wait; its latency was most of its cost at batch 1.
With one split, stage 1 writes the output directly.

Loop bounds come from ``seq_lens`` in device memory and the grid only from the batch size and head
counts, so one launch is valid for any lengths: no host sync, no plan step, CUDA-graph safe (a graph
keeps the slot table's address: the engine's table is allocated once).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from modeserve.kernels.triton.pdl import pdl_args, pdl_prologue

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr,  # q [B, Hq, D]; k/v cache [num_slots, Hkv, D]
    table_ptr,  # req_to_token [max_reqs, max_context] int64: the KV slot of each position
    req_pool_ptr, seq_lens_ptr,  # [B]
    mid_o_ptr, mid_lse_ptr, out_ptr,  # [B, Hq, S, D] fp32, [B, Hq, S] fp32; out [B, Hq, D]
    counter_ptr,  # [B, Hkv] int32, zero between launches: slices finished per (request, kv head)
    scale_log2, window,  # window <= 0: none
    table_stride, stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(req_pool_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)

    # keys [kv_start, seq_len) are visible; this program takes one BLOCK_N-aligned slice of them
    kv_start = 0
    if window > 0:
        kv_start = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h  # query heads sharing this kv head
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    row = table_ptr + req * table_stride
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(row + offs_n, mask=mask_n, other=0)  # [BLOCK_N] int64
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every slice step has a visible key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:  # the whole answer: no merge
        tl.store(out_ptr + b.to(tl.int64) * stride_outb + heads[:, None] * stride_outh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
        return
    # an empty slice (short sequence, many splits) writes o = 0 and lse = -inf: the merge weighs it 0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    head_mask = mask_h[:, None] & mask_d[None, :]
    o_base = mid_o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    lse_base = mid_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh
    tl.store(o_base + split * stride_os, o, mask=head_mask)
    tl.store(lse_base + split, lse, mask=mask_h)
    tl.debug_barrier()  # every thread's stores precede the count (the atomic releases them at gpu scope)
    counter = counter_ptr + b * tl.num_programs(1) + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
        _merge_slices(o_base, lse_base, out_ptr + b.to(tl.int64) * stride_outb + heads[:, None] * stride_outh
                      + offs_d[None, :], stride_os, mask_h, head_mask, NUM_SPLITS, BLOCK_H, BLOCK_D, BLOCK_S)
        tl.store(counter, 0)


@triton.jit
def _merge_slices(o_base, lse_base, out_ptrs, stride_os, mask_h, head_mask,
                  NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """out[h] = sum_s w[h, s] o[h, s] / sum_s w[h, s], w = 2^(lse - max lse); loads skip L1 (``.cg``):
    other SMs wrote the slices, and this SM may hold stale lines of the same buffer from an earlier layer."""
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(lse_base[:, None] + offs_s[None, :], mask=mask_h[:, None] & (offs_s < NUM_SPLITS)[None, :],
                      other=float("-inf"), cache_modifier=".cg")  # [BLOCK_H, BLOCK_S]
    lse_max = tl.where(mask_h, tl.max(lse_all, 1), 0.0)  # finite for real heads: slice 0 always has keys
    denom = tl.sum(tl.exp2(lse_all - lse_max[:, None]), 1)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        w = tl.exp2(tl.load(lse_base + s, mask=mask_h, other=float("-inf"), cache_modifier=".cg") - lse_max)
        acc += w[:, None] * tl.load(o_base + s * stride_os, mask=head_mask, other=0.0, cache_modifier=".cg")
    out = acc / tl.where(mask_h, denom, 1.0)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=head_mask)


def default_num_kv_splits(batch_size: int, num_kv_heads: int, device: torch.device, max_splits: int = 32) -> int:
    """Splits per (request, kv head) so that stage 1 has about two programs per SM; 1 for big batches.
    (``bench attention`` on an H200 at batch 1: 32 splits took 10.64 against 16's 10.96 µs per layer
    at head_dim 128, 8.56 against 9.02 at head_dim 64, gains near the run-to-run spread of about 5%;
    at batch 64 one split beat 4 and 32 clearly: 82 against 91 and 121 µs.)

    Depends only on the batch size and heads, so a captured graph and an eager step agree."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(max_splits, math.ceil(2 * num_sms / max(batch_size * num_kv_heads, 1))))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, num_kv_splits: int | None = None,
                     counters: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D], k/v_cache: [num_slots, Hkv, D], req_to_token: [max_reqs, max_context] int64 (rows
    contiguous), req_pool_indices/seq_lens: [B] -> out [B, Hq, D] in q's dtype.

    ``counters``: int32 zeros, at least B * Hkv of them, that the kernel leaves at zero (keep one
    buffer across calls and in CUDA graphs); None: allocated here.
    A query sees keys at positions > seq_len - 1 - sliding_window (all of them without a window)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads or q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("need num_heads a multiple of num_kv_heads and a contiguous head_dim")
    if req_to_token.dtype != torch.int64 or req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be [max_reqs, max_context] int64 with contiguous rows")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    splits = num_kv_splits or default_num_kv_splits(batch, num_kv_heads, q.device)
    if counters is None:
        counters = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=q.device)
    elif counters.dtype != torch.int32 or counters.numel() < batch * num_kv_heads:
        raise ValueError(f"counters must be int32 with at least {batch * num_kv_heads} elements")
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_mid = batch if splits > 1 else 1  # one split writes ``out`` directly
    mid_o = torch.empty(num_mid, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(num_mid, num_heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, out, counters,
        scale * LOG2E, sliding_window or 0,
        req_to_token.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=splits, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=32, BLOCK_D=block_d,  # spill-free on sm_90 (bf16) for head_dim up to 256
        BLOCK_S=triton.next_power_of_2(splits),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4 if head_dim <= 128 else 8,
        **pdl_args(q.device),
    )
    return out
