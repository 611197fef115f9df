"""Paged decode attention in Triton: one query token per request, split-K (flash decoding); or the
``queries`` consecutive query tokens a TARGET_VERIFY step gives each request (its last token and its
drafts, causal among themselves), all attended in the same program, so each key is read once.

Request b's keys are the KV slots ``req_to_token[req_pool_indices[b], 0:seq_lens[b]]`` (token-level
indirection, so any page size works). Stage 1 runs one program per (request, kv head, split): it
attends all query heads of that kv head (GQA) to one slice of the keys, with online softmax in fp32,
and writes the slice's normalised output and log-sum-exp. The slices are merged per query head by
the program of each (request, kv head) that finishes last: every program counts itself in on a
device counter after its slice is written (an acq_rel atomic after a CTA barrier, so the slice is
visible before the count), and the one that sees the others all in reads the slices back past L1,
merges them, writes the output and resets the counter to 0 for the next launch: no separate merge
kernel per layer, whose launch and dependency wait would dominate its cost at batch 1.
With one split, stage 1 writes the output directly. With several queries a request, a program's rows
are (query, head) pairs and each row masks the keys past its own position.

Loop bounds come from ``seq_lens`` in device memory and the grid only from the batch size and head
counts, so one launch is valid for any lengths: no host sync, no plan step, CUDA-graph safe (a graph
keeps the slot table's address: the engine's table is allocated once).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue, pdl_release, pdl_wait
from .rotary import _round

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr,  # q [B * QUERIES, Hq, D]; k/v cache [num_slots, Hkv, D]
    table_ptr,  # req_to_token [max_reqs, max_context] int64: the KV slot of each position
    req_pool_ptr, seq_lens_ptr,  # [B]
    mid_o_ptr, mid_lse_ptr, out_ptr,  # [B * QUERIES, Hq, S, D] fp32, [B * QUERIES, Hq, S] fp32; out like q
    counter_ptr,  # [B, Hkv] int32, zero between launches: slices finished per (request, kv head)
    # with ROTARY: q is not rotated yet; this step's k/v [B, Hkv, D] (k not rotated), positions [B],
    # cos_sin [max_pos, D] = [cos | sin] (fp32) and the KV slots [B] they are stored at
    k_new_ptr, v_new_ptr, pos_ptr, cos_sin_ptr, loc_ptr,
    scale_log2, window,  # window <= 0: none
    table_stride, stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROTARY: tl.constexpr, USE_PDL: tl.constexpr, QUERIES: tl.constexpr,
    WHOLE_ROW: tl.constexpr,  # a request's queries all see each other (a DLLM block), not causally
):
    if ROTARY:
        pdl_release(USE_PDL)  # waits below, after loading its first block of older keys
    else:
        pdl_prologue(USE_PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(req_pool_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    newest = seq_len - 1  # with ROTARY this step's key, not in the cache yet

    # keys [kv_start, seq_len) are visible (to the request's first query, from kv_start); this
    # program takes one BLOCK_N-aligned slice of them
    kv_start = 0
    if window > 0:
        kv_start = tl.maximum(seq_len - (QUERIES - 1) - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP * QUERIES
    mask_d = offs_d < HEAD_DIM
    if QUERIES == 1:
        heads = kv_head * GROUP + offs_h  # query heads sharing this kv head
        tok = b.to(tl.int64)  # the query token (of every row)
        tok_rows = tok
    else:  # row i: head i % GROUP of the group, query i // GROUP, which sees keys below its limit
        heads = kv_head * GROUP + offs_h % GROUP
        tok = b.to(tl.int64) * QUERIES + offs_h // GROUP  # [BLOCK_H]
        tok_rows = tok[:, None]
        if WHOLE_ROW:
            limit = seq_len + offs_h * 0
        else:
            limit = seq_len - (QUERIES - 1) + offs_h // GROUP
    row = table_ptr + req * table_stride
    first = lo
    if ROTARY:
        # keys of earlier steps (and the rows, lengths and slot table, written before this step's
        # first kernel) are final before any kernel of the step runs: the first block streams in
        # before the wait, while the kernels this one waits for still run; this step's key is not
        # read from the cache (it is rotated from the projection below)
        offs_n0 = lo + tl.arange(0, BLOCK_N)
        mask_n0 = (offs_n0 < hi) & (offs_n0 != newest)
        k0, v0 = _load_kv_block(row, k_ptr, v_ptr, offs_n0, mask_n0, kv_head, offs_d, mask_d,
                                stride_kt, stride_kh, stride_vt, stride_vh)
        pdl_wait(USE_PDL)
        first = lo + BLOCK_N
    q_rows = q_ptr + tok_rows * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if ROTARY:
        # neox rotate-half of q here, as the rotary kernel computes it (each product rounded to q's
        # dtype): out[d] = x[d] cos[d % half] -+ x[partner(d)] sin[d % half]
        partner = (offs_d + HEAD_DIM // 2) % HEAD_DIM
        sign = tl.where(offs_d < HEAD_DIM // 2, -1.0, 1.0)
        cs = cos_sin_ptr + tl.load(pos_ptr + b).to(tl.int64) * stride_cs + offs_d % (HEAD_DIM // 2)
        cos = tl.load(cs, mask=mask_d, other=0.0)
        sin = tl.load(cs + HEAD_DIM // 2, mask=mask_d, other=0.0)
        q_partner = tl.load(q_rows + partner[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        q = _rotate(q, q_partner, cos[None, :], sin[None, :], sign[None, :]).to(q.dtype)
        if (lo <= newest) & (newest < hi):
            # this program's slice holds this step's key: it rotates it, attends to it first (so no
            # block of the loop below is all masked) and is the one that stores the step's k/v
            k_row = k_new_ptr + b.to(tl.int64) * stride_knb + kv_head * stride_knh
            k_new = _rotate(tl.load(k_row + offs_d, mask=mask_d, other=0.0),
                            tl.load(k_row + partner, mask=mask_d, other=0.0), cos, sin, sign)
            k_new = k_new.to(k_new_ptr.dtype.element_ty).to(k_ptr.dtype.element_ty)
            v_new = tl.load(v_new_ptr + b.to(tl.int64) * stride_vnb + kv_head * stride_vnh + offs_d, mask=mask_d,
                            other=0.0).to(v_ptr.dtype.element_ty)
            slot = tl.load(loc_ptr + b).to(tl.int64)
            tl.store(k_ptr + slot * stride_kt + kv_head * stride_kh + offs_d, k_new, mask=mask_d)
            tl.store(v_ptr + slot * stride_vt + kv_head * stride_vh + offs_d, v_new, mask=mask_d)
            m_i = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale_log2
            l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32) + v_new.to(tl.float32)[None, :]
        if lo < hi:  # the prefetched block (if it holds only this step's key, m_i is finite already)
            m_i, l_i, acc = _attend_block(q, k0, v0, mask_n0[None, :], m_i, l_i, acc, scale_log2, DOT_PRECISION,
                                          False)
    for start in range(first, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        if ROTARY:
            mask_n = mask_n & (offs_n != newest)  # attended above, from registers
        k, v = _load_kv_block(row, k_ptr, v_ptr, offs_n, mask_n, kv_head, offs_d, mask_d,
                              stride_kt, stride_kh, stride_vt, stride_vh)
        if QUERIES == 1:  # finite: every block has a visible key, or m_i is finite already
            m_i, l_i, acc = _attend_block(q, k, v, mask_n[None, :], m_i, l_i, acc, scale_log2, DOT_PRECISION, False)
        else:  # a row may see none of a block (the last drafts' keys, or before its window)
            seen = mask_n[None, :] & (offs_n[None, :] < limit[:, None])
            if window > 0:
                seen = seen & (offs_n[None, :] >= limit[:, None] - window)
            m_i, l_i, acc = _attend_block(q, k, v, seen, m_i, l_i, acc, scale_log2, DOT_PRECISION, True)

    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:  # the whole answer: no merge
        tl.store(out_ptr + tok_rows * stride_outb + heads[:, None] * stride_outh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
        return
    # an empty slice (short sequence, many splits) writes o = 0 and lse = -inf: the merge weighs it 0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    head_mask = mask_h[:, None] & mask_d[None, :]
    o_base = mid_o_ptr + tok_rows * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    lse_base = mid_lse_ptr + tok * stride_lb + heads * stride_lh
    tl.store(o_base + split * stride_os, o, mask=head_mask)
    tl.store(lse_base + split, lse, mask=mask_h)
    tl.debug_barrier()  # every thread's stores precede the count (the atomic releases them at gpu scope)
    counter = counter_ptr + b * tl.num_programs(1) + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
        _merge_slices(o_base, lse_base, out_ptr + tok_rows * stride_outb + heads[:, None] * stride_outh
                      + offs_d[None, :], stride_os, mask_h, head_mask, NUM_SPLITS, BLOCK_H, BLOCK_D, BLOCK_S)
        tl.store(counter, 0)


@triton.jit
def _rotate(x, x_partner, cos, sin, sign):
    """Neox rotate-half of rows loaded whole (``x_partner``: x at each column's partner, ``sign``: -1 on
    the first half), each product rounded to x's dtype as the rotary kernel computes it; fp32 out."""
    cos_x, sin_x = _round(cos, x.dtype), _round(sin, x.dtype)
    return _round(x.to(tl.float32) * cos_x, x.dtype) + sign * _round(x_partner.to(tl.float32) * sin_x, x.dtype)


@triton.jit
def _load_kv_block(row, k_ptr, v_ptr, offs_n, mask_n, kv_head, offs_d, mask_d,
                   stride_kt, stride_kh, stride_vt, stride_vh):
    """Keys and values [BLOCK_N, BLOCK_D] of positions ``offs_n`` (where ``mask_n``) through the slot row."""
    slots = tl.load(row + offs_n, mask=mask_n, other=0)  # [BLOCK_N] int64
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _attend_block(q, k, v, seen, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr, MAY_BE_EMPTY: tl.constexpr):
    """One block of keys into the online softmax: (m_i, l_i, acc) updated. ``seen``: which keys each
    row attends ([1, BLOCK_N] or [BLOCK_H, BLOCK_N]); ``MAY_BE_EMPTY``: a row may have seen no key yet
    and none in this block (it then stays empty: no NaN from -inf - -inf)."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # m_i is -inf too: alpha and p are 0
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


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


class DecodeRotary(NamedTuple):
    """What a decode step's attention needs to do the rotary embedding and the KV store itself."""

    k: torch.Tensor  # [B, Hkv, D] this step's keys, not rotated (any row/head stride, head dim contiguous)
    v: torch.Tensor  # [B, Hkv, D]
    positions: torch.Tensor  # [B] int
    cos_sin: torch.Tensor  # [max_pos, D] = [cos | sin], float32
    loc: torch.Tensor  # [B] int64: the KV slots the step's k/v go to

    def check(self, batch: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor) -> None:
        if self.k.shape != (batch, num_kv_heads, head_dim) or self.v.shape != self.k.shape or head_dim % 2:
            raise ValueError(f"rotary k/v must be [{batch}, {num_kv_heads}, {head_dim}] with an even head_dim")
        if self.k.stride(2) != 1 or self.v.stride(2) != 1 or self.cos_sin.stride(1) != 1:
            raise ValueError("rotary k/v and cos_sin need a contiguous last dim")
        if self.positions.shape != (batch,) or self.loc.shape != (batch,) or self.cos_sin.shape[1] != head_dim:
            raise ValueError("rotary positions/loc must be [B] and cos_sin [max_pos, head_dim]")


@dataclass(frozen=True)
class DecodeTiles:
    """The decode kernel's launch shape: keys per loop step, warps per program (None: 4 up to head_dim
    128, else 8) and software-pipeline stages (None: Triton's default). ``default_decode_tiles`` picks
    what the engine runs; ``bench attention`` times others (``triton@SPLITS:BLOCK_N:WARPS:STAGES``). A shape
    the kernel cannot launch is refused when made (ValueError)."""

    block_n: int = 32  # spill-free on sm_90 (bf16) for head_dim up to 256
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n > 256 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two in [16, 256], got {self.block_n}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages is not None and not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in [1, 8], got {self.num_stages}")


@functools.lru_cache(maxsize=None)  # called per layer on eager steps: one frozen shape per (splits, head_dim)
def default_decode_tiles(num_kv_splits: int, head_dim: int) -> DecodeTiles:
    """The launch shape ``decode_attention`` uses when none is given: with one split (big batches,
    where programs are plenty and each walks its whole context) 64 keys a step, 4 warps and 3 pipeline
    stages, up to head_dim 128 (96 KiB of keys and values in flight at 128); else ``DecodeTiles()``.
    Chosen with ``bench attention``: at one split this shape comes closest to the bandwidth roofline."""
    if num_kv_splits == 1 and head_dim <= 128:
        return DecodeTiles(block_n=64, num_warps=4, num_stages=3)
    return DecodeTiles()


def default_num_kv_splits(batch_size: int, num_kv_heads: int, device: torch.device, max_splits: int = 12) -> int:
    """Splits per (request, kv head) so that stage 1 has about two programs per SM, at most
    ``max_splits``; 1 for big batches. The cap: the program that merges reads back every split, so
    past a dozen the merge's tail costs more than shorter slices save (``bench attention``).

    Depends only on the batch size and heads, so a captured graph and an eager step agree."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(max_splits, math.ceil(2 * num_sms / max(batch_size * num_kv_heads, 1))))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, num_kv_splits: int | None = None,
                     counters: torch.Tensor | None = None, rotary: DecodeRotary | None = None,
                     tiles: DecodeTiles | None = None, queries: int = 1, whole_row: bool = False) -> torch.Tensor:
    """q: [B, Hq, D], k/v_cache: [num_slots, Hkv, D], req_to_token: [max_reqs, max_context] int64 (rows
    contiguous), req_pool_indices/seq_lens: [B] -> out [B, Hq, D] in q's dtype.

    ``queries``: q is [B * queries, Hq, D], request b's ``queries`` consecutive query tokens at the
    last positions of its ``seq_lens[b]`` (a TARGET_VERIFY step's), each seeing the keys up to its
    own position (their keys must be in the cache: no ``rotary``); the output is shaped like q.
    ``whole_row``: each of them sees all of the request's keys, the other queries' too (the current
    block of a DLLM_EXTEND step, block-causal; no sliding window).

    ``counters``: int32 zeros, at least B * Hkv of them, that the kernel leaves at zero (keep one
    buffer across calls and in CUDA graphs); None: allocated here.
    ``rotary``: q and the step's k are not rotated yet and its k/v are not in the cache: the kernel
    does what ``apply_rotary_and_store_kv`` would have done first (same numbers), in the same launch.
    ``tiles``: the launch shape (None: ``default_decode_tiles``).
    A query sees keys at positions > seq_len - 1 - sliding_window (all of them without a window)."""
    tokens, num_heads, head_dim = q.shape
    batch = tokens // queries  # requests
    num_kv_heads = k_cache.shape[1]
    if queries < 1 or tokens % queries or req_pool_indices.shape[0] != batch or (queries > 1 and rotary is not None):
        raise ValueError(f"{tokens} query rows are not {queries} a request for {req_pool_indices.shape[0]} "
                         "requests (several a request: no rotary)")
    if whole_row and sliding_window:
        raise ValueError("whole-row queries (a block) take no sliding window")
    if num_heads % num_kv_heads or q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("need num_heads a multiple of num_kv_heads and a contiguous head_dim")
    if req_to_token.dtype != torch.int64 or req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be [max_reqs, max_context] int64 with contiguous rows")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    splits = num_kv_splits or default_num_kv_splits(batch, num_kv_heads, q.device)
    tiles = tiles or default_decode_tiles(splits, head_dim)
    if counters is None:
        counters = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=q.device)
    elif counters.dtype != torch.int32 or counters.numel() < batch * num_kv_heads:
        raise ValueError(f"counters must be int32 with at least {batch * num_kv_heads} elements")
    if rotary is not None:
        rotary.check(batch, num_kv_heads, head_dim, k_cache)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    r = rotary if rotary is not None else DecodeRotary(q[:, :1], q[:, :1], seq_lens, q.new_zeros(1, 1, dtype=torch.float32),
                                                       seq_lens)  # never read without ROTARY
    num_mid = tokens if splits > 1 else 1  # one split writes ``out`` directly
    mid_o = torch.empty(num_mid, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(num_mid, num_heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, out, counters,
        r.k, r.v, r.positions, r.cos_sin, r.loc,
        scale * LOG2E, sliding_window or 0,
        req_to_token.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), r.k.stride(0), r.k.stride(1), r.v.stride(0), r.v.stride(1), r.cos_sin.stride(0),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=splits, BLOCK_H=max(16, triton.next_power_of_2(group * queries)),
        BLOCK_N=tiles.block_n, BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(splits),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ROTARY=rotary is not None, QUERIES=queries,
        WHOLE_ROW=whole_row and queries > 1,
        num_warps=tiles.num_warps or (4 if head_dim <= 128 else 8),
        **({} if tiles.num_stages is None else {"num_stages": tiles.num_stages}), **pdl_args(q.device),
    )
    return out
