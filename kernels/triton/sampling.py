"""The sampling step after the sort in one Triton kernel: top-k / top-p / min-p over logits sorted
descending and the seeded Gumbel-max draw over what they keep. Same signature and numbers as
``kernels.sampling.sample_sorted`` (its torch reference: a softmax, a cumsum, a gather, the noise's
hash rounds and a dozen elementwise passes over [B, V], each a kernel reading and writing the whole
row).

One program per row, two passes over the row: the first sums the softmax denominator and the top-k
mass; the second walks the ranks in blocks with a running (exclusive) cumulative probability, keeps
the ranks that pass the three filters, adds the noise of each kept rank's vocab id and keeps the first
maximum. Every filter keeps a prefix of the sorted row, so the second pass stops at rank ``top_k``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeserve.kernels import sampling

BLOCK = 1024  # ranks per iteration
# the hash's constants, as compile-time values of the kernels
MASK32 = tl.constexpr(sampling.MASK32)
GOLDEN32 = tl.constexpr(sampling.GOLDEN32)
SALT_POS = tl.constexpr(sampling.SALT_POS)
SALT_IDX = tl.constexpr(sampling.SALT_IDX)
HASH_MUL1 = tl.constexpr(sampling.HASH_MUL1)
HASH_MUL2 = tl.constexpr(sampling.HASH_MUL2)


@triton.jit
def _hash32(x):
    """lowbias32 over uint32 values held in int64, as ``kernels.sampling.hash32``."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * HASH_MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * HASH_MUL2) & MASK32
    x = x ^ (x >> 16)
    return x


@triton.jit
def _sample_sorted_kernel(x_ptr, ids_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, pos_ptr, out_ptr,
                          V, stride_x, stride_ids, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    ids_row = ids_ptr + row * stride_ids
    top = tl.load(x_row).to(tl.float32)  # sorted descending: rank 0 holds the maximum
    k = tl.load(top_k_ptr + row)
    k = tl.where(k <= 0, V, tl.minimum(k, V)).to(tl.int32)

    # pass 1: the softmax denominator (relative to the top) and the unnormalised top-k mass
    total = tl.zeros([BLOCK], tl.float32)
    in_k = tl.zeros([BLOCK], tl.float32)
    for off in range(0, V, BLOCK):
        cols = off + lanes
        e = tl.exp(tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) - top)
        total += e
        in_k += tl.where(cols < k, e, 0.0)
    z = tl.sum(total, axis=0)
    top_p = tl.load(top_p_ptr + row)
    # top_p of the renormalised top-k mass; top_p == 1 never drops a rounding tail
    p_cut = tl.where(top_p >= 1.0, float("inf"), top_p * (tl.sum(in_k, axis=0) / z))
    p_min = tl.load(min_p_ptr + row) * (1.0 / z)  # min_p times the top probability

    # the row's noise key, as kernels.sampling.row_keys
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    key = _hash32((seed & MASK32) ^ GOLDEN32)
    key = _hash32(key ^ ((seed >> 32) & MASK32))
    key = _hash32((key + SALT_POS) ^ (pos & MASK32))
    key = _hash32(key ^ ((pos >> 32) & MASK32) ^ SALT_IDX)

    # pass 2: filters, noise, first maximum; nothing past rank k is kept
    carry = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)  # probability mass above this block
    best = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0) + float("-inf")
    best_rank = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
    for off in range(0, k, BLOCK):
        cols = off + lanes
        inside = cols < k
        x = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - top) / z
        above = tl.cumsum(p, axis=0) - p + carry  # exclusive cumulative probability
        carry += tl.sum(p, axis=0)
        keep = inside & (above < p_cut) & (p >= p_min)
        keep = keep | (cols == 0)
        vid = tl.load(ids_row + cols, mask=inside, other=0)
        h = _hash32(key ^ _hash32(vid * GOLDEN32 + SALT_IDX))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(keep, x - tl.log(-tl.log(u)), float("-inf"))
        m = tl.max(score, axis=0)
        r = tl.min(tl.where(score == m, cols, 2147483647), axis=0)
        take = m > best  # strict: an earlier block keeps its rank on ties, as torch.argmax
        best_rank = tl.where(take, r, best_rank)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, tl.load(ids_row + best_rank))


def sample_sorted(sorted_logits: torch.Tensor, sorted_ids: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                  min_ps: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``kernels.sampling.sample_sorted`` in one kernel: sorted_logits [B, V] float (descending, temperature
    applied), sorted_ids [B, V] int64, top_ks [B] int64, top_ps / min_ps [B] float32, seeds / positions [B]
    int64 -> [B] int64 token ids."""
    if sorted_logits.dim() != 2 or sorted_ids.shape != sorted_logits.shape:
        raise ValueError(f"sample_sorted takes [B, V] logits and ids of the same shape, got "
                         f"{tuple(sorted_logits.shape)} and {tuple(sorted_ids.shape)}")
    rows, vocab = sorted_logits.shape
    if sorted_logits.stride(1) != 1 or sorted_ids.stride(1) != 1 or sorted_ids.dtype != torch.int64:
        raise ValueError("sample_sorted needs a contiguous last dim and int64 ids")
    params = (top_ks, top_ps, min_ps, seeds, positions)
    if any(t.shape != (rows,) or not t.is_contiguous() for t in params):
        raise ValueError(f"sample_sorted's per-row parameters must be contiguous [{rows}] tensors")
    if top_ks.dtype != torch.int64 or seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError("sample_sorted's top_ks, seeds and positions must be int64")
    out = torch.empty(rows, dtype=torch.int64, device=sorted_logits.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("sample_sorted needs at least one token per row")
    _sample_sorted_kernel[(rows,)](sorted_logits, sorted_ids, top_ks, top_ps.to(torch.float32),
                                   min_ps.to(torch.float32), seeds, positions, out, vocab,
                                   sorted_logits.stride(0), sorted_ids.stride(0), BLOCK=BLOCK, num_warps=8)
    return out
