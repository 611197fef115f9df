"""The sampling step after the sort fused into three Triton launches: top-k / top-p / min-p over logits sorted
descending and the seeded Gumbel-max draw over what they keep. Same signature and numbers as
``kernels.sampling.sample_sorted`` (its torch reference: a softmax, a cumsum, a gather, the noise's
hash rounds and a dozen elementwise passes over [B, V], each a kernel reading and writing the whole
row).

The first two launches have one program per chunk of ranks of a row (so one row spreads over
the device too): the first sums each chunk's share of the softmax denominator and of the top-k mass;
the second gets the row's totals and the mass above its chunk from those sums, walks its ranks with a
running (exclusive) cumulative probability, keeps the ranks that pass the three filters, adds the noise
of each kept rank's vocab id and finds the chunk's first maximum; the third picks each row's first
maximum among its chunks. Every filter keeps a prefix of the sorted row, so a chunk past rank
``top_k`` or past the top-p cut reads nothing in the second pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import sampling
from .argmax import first_of_chunk_maxima

CHUNK = 4096  # ranks per program
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
def _chunk_mass_kernel(x_ptr, top_k_ptr, mass_ptr, V, stride_x, num_chunks,
                       CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1, one program per (row, chunk of ranks): the chunk's sum of exp(x - top), all of it and the
    part inside the top k."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    top = tl.load(x_row).to(tl.float32)  # sorted descending: rank 0 holds the maximum
    k = tl.load(top_k_ptr + row)
    k = tl.where(k <= 0, V, tl.minimum(k, V)).to(tl.int32)
    total = tl.zeros([BLOCK], tl.float32)
    in_k = tl.zeros([BLOCK], tl.float32)
    for off in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + off + lanes
        e = tl.exp(tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) - top)
        total += e
        in_k += tl.where(cols < k, e, 0.0)
    at = mass_ptr + (row * num_chunks + chunk) * 2
    tl.store(at, tl.sum(total, axis=0))
    tl.store(at + 1, tl.sum(in_k, axis=0))


@triton.jit
def _chunk_draw_kernel(x_ptr, ids_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, pos_ptr, mass_ptr,
                       best_ptr, rank_ptr, V, stride_x, stride_ids, num_chunks,
                       CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_POW2: tl.constexpr):
    """Pass 2, one program per (row, chunk): the filters, the noise and the chunk's first maximum.
    A chunk past rank k, or whose ranks all lie past the top-p cut, reads nothing."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    ids_row = ids_ptr + row * stride_ids
    top = tl.load(x_row).to(tl.float32)
    k = tl.load(top_k_ptr + row)
    k = tl.where(k <= 0, V, tl.minimum(k, V)).to(tl.int32)

    chunks = tl.arange(0, CHUNKS_POW2)
    masses = mass_ptr + (row * num_chunks + chunks) * 2
    totals = tl.load(masses, mask=chunks < num_chunks, other=0.0)
    z = tl.sum(totals, axis=0)
    carry = tl.sum(tl.where(chunks < chunk, totals, 0.0), axis=0) / z  # probability above this chunk
    top_p = tl.load(top_p_ptr + row)
    # top_p of the renormalised top-k mass; top_p == 1 never drops a rounding tail
    in_k = tl.load(masses + 1, mask=chunks < num_chunks, other=0.0)
    p_cut = tl.where(top_p >= 1.0, float("inf"), top_p * (tl.sum(in_k, axis=0) / z))
    p_min = tl.load(min_p_ptr + row) * (1.0 / z)  # min_p times the top probability

    best = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0) + float("-inf")
    best_rank = chunk * CHUNK
    if (chunk * CHUNK < k) & ((carry < p_cut) | (chunk == 0)):
        # the row's noise key, as kernels.sampling.row_keys
        seed = tl.load(seed_ptr + row)
        pos = tl.load(pos_ptr + row)
        key = _hash32((seed & MASK32) ^ GOLDEN32)
        key = _hash32(key ^ ((seed >> 32) & MASK32))
        key = _hash32((key + SALT_POS) ^ (pos & MASK32))
        key = _hash32(key ^ ((pos >> 32) & MASK32) ^ SALT_IDX)
        for off in range(0, CHUNK, BLOCK):
            cols = chunk * CHUNK + off + lanes
            inside = cols < k
            x = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            p = tl.exp(x - top) / z
            above = tl.cumsum(p, axis=0) - p + carry  # exclusive cumulative probability
            carry += tl.sum(p, axis=0)
            keep = (inside & (above < p_cut) & (p >= p_min)) | (cols == 0)  # the top token always stays
            vid = tl.load(ids_row + cols, mask=inside, other=0)
            h = _hash32(key ^ _hash32(vid * GOLDEN32 + SALT_IDX))
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = tl.where(keep, x - tl.log(-tl.log(u)), float("-inf"))
            m = tl.max(score, axis=0)
            r = tl.min(tl.where(score == m, cols, 2147483647), axis=0)
            take = m > best  # strict: an earlier block keeps its rank on ties, as torch.argmax
            best_rank = tl.where(take, r, best_rank)
            best = tl.where(take, m, best)
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(rank_ptr + row * num_chunks + chunk, best_rank)


@triton.jit
def _row_pick_kernel(ids_ptr, best_ptr, rank_ptr, out_ptr, stride_ids, num_chunks, CHUNKS_POW2: tl.constexpr):
    """One program per row: the first maximum among the chunks' maxima, and its vocab id."""
    row = tl.program_id(0).to(tl.int64)
    first = first_of_chunk_maxima(best_ptr, rank_ptr, row, num_chunks, CHUNKS_POW2)
    tl.store(out_ptr + row, tl.load(ids_ptr + row * stride_ids + first))


def sample_sorted(sorted_logits: torch.Tensor, sorted_ids: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                  min_ps: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``kernels.sampling.sample_sorted`` fused: sorted_logits [B, V] float (descending, temperature
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
    chunks = triton.cdiv(vocab, CHUNK)
    mass = torch.empty(rows, chunks, 2, dtype=torch.float32, device=sorted_logits.device)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=sorted_logits.device)
    rank = torch.empty(rows, chunks, dtype=torch.int32, device=sorted_logits.device)
    pow2 = triton.next_power_of_2(chunks)
    _chunk_mass_kernel[(rows, chunks)](sorted_logits, top_ks, mass, vocab, sorted_logits.stride(0), chunks,
                                       CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    _chunk_draw_kernel[(rows, chunks)](sorted_logits, sorted_ids, top_ks, top_ps.to(torch.float32),
                                       min_ps.to(torch.float32), seeds, positions, mass, best, rank, vocab,
                                       sorted_logits.stride(0), sorted_ids.stride(0), chunks,
                                       CHUNK=CHUNK, BLOCK=BLOCK, CHUNKS_POW2=pow2, num_warps=4)
    _row_pick_kernel[(rows,)](sorted_ids, best, rank, out, sorted_ids.stride(0), chunks, CHUNKS_POW2=pow2,
                              num_warps=1)
    return out
