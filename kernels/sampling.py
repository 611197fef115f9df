"""The sampling step after the sort, as torch references: top-k / top-p / min-p over logits sorted
descending, then a seeded Gumbel-max draw. ``kernels.triton.sampling.sample_sorted`` is the same step
fused into one kernel, with the same signature.

Filter semantics (Hugging Face / vLLM order): softmax -> keep the ``top_k`` most probable tokens ->
renormalise and keep the smallest prefix whose cumulative probability reaches ``top_p`` (the top token
always stays) -> drop tokens whose probability is below ``min_p`` times the top probability. All three
masks are prefixes of the sorted row.

The draw is ``argmax(log p + g)`` over the kept tokens with Gumbel noise ``g`` that is a pure function of
``(seed, position, vocab id)``: a seeded request yields the same token whatever else is in the batch, in
whatever order, and again when it is recomputed after preemption.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9  # 2**32 / golden ratio: decorrelates the inputs before each hash round
SALT_POS = 0x85EBCA6B
SALT_IDX = 0xC2B2AE35
HASH_MUL1 = 0x7FEB352D
HASH_MUL2 = 0x846CA68B

# sample_sorted's signature (the torch reference below, or the fused Triton kernel)
SampleSorted = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def hash32(x: Tensor) -> Tensor:
    """lowbias32 avalanche hash of uint32 values held in int64 (any shape -> same shape, in [0, 2**32))."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * HASH_MUL1) & MASK32  # int64 wrap-around only touches bits above 32, masked away
    x = x ^ (x >> 15)
    x = (x * HASH_MUL2) & MASK32
    x = x ^ (x >> 16)
    return x


def row_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """One 32-bit stream key per (seed, position): [B] int64 -> [B] int64 in [0, 2**32)."""
    seed_lo = seeds & MASK32  # [B]
    seed_hi = (seeds >> 32) & MASK32  # [B]; arithmetic shift, then mask = the raw high word
    key = hash32(seed_lo ^ GOLDEN32)  # [B]
    key = hash32(key ^ seed_hi)  # [B]
    key = hash32((key + SALT_POS) ^ (positions & MASK32))  # [B]
    return hash32(key ^ ((positions >> 32) & MASK32) ^ SALT_IDX)  # [B]


def gumbel_noise(seeds: Tensor, positions: Tensor, vocab_ids: Tensor) -> Tensor:
    """Standard Gumbel noise, a pure function of (seed, position, vocab id).

    seeds, positions: [B] int64; vocab_ids: [B, N] int64 (>= 0), any order -> [B, N] float32.
    """
    keys = row_keys(seeds, positions)  # [B]
    x = hash32(keys[:, None] ^ hash32(vocab_ids * GOLDEN32 + SALT_IDX))  # [B, N] in [0, 2**32)
    # Top 24 bits -> u strictly inside (0, 1), exactly representable in float32.
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # [B, N]
    return -torch.log(-torch.log(u))  # [B, N]


def keep_mask_sorted(sorted_logits: Tensor, top_ks: Tensor, top_ps: Tensor, min_ps: Tensor) -> Tensor:
    """Which ranks survive top-k, top-p and min-p. sorted_logits: [B, V] descending; top_ks [B] int64
    (<= 0: off), top_ps [B] in (0, 1], min_ps [B] in [0, 1] -> [B, V] bool."""
    vocab = sorted_logits.shape[1]
    probs = torch.softmax(sorted_logits.to(torch.float32), dim=-1)  # [B, V] descending
    ranks = torch.arange(vocab, device=sorted_logits.device)  # [V]

    top_ks = torch.where(top_ks <= 0, torch.full_like(top_ks, vocab), top_ks.clamp(max=vocab))  # [B]
    keep = ranks[None, :] < top_ks[:, None]  # [B, V]

    # Top-p on the top-k renormalised distribution. The top-k set is a prefix, so the plain cumsum is
    # the masked cumsum inside it and the kept mass is the cumsum at rank k - 1.
    cumsum = torch.cumsum(probs, dim=-1)  # [B, V]
    topk_mass = cumsum.gather(1, (top_ks - 1)[:, None])  # [B, 1]
    exclusive = cumsum - probs  # [B, V]; mass strictly above each rank
    top_ps = top_ps.to(torch.float32)[:, None]  # [B, 1]
    keep_p = (exclusive < top_ps * topk_mass) | (top_ps >= 1.0)  # top_p == 1 never drops a rounding tail
    keep = keep & keep_p

    # Min-p: ratios to the top probability do not change under renormalisation.
    keep = keep & (probs >= min_ps.to(torch.float32)[:, None] * probs[:, :1])  # [B, V]
    keep[:, 0] = True  # the most probable token always stays
    return keep


def sample_sorted(sorted_logits: Tensor, sorted_ids: Tensor, top_ks: Tensor, top_ps: Tensor, min_ps: Tensor,
                  seeds: Tensor, positions: Tensor) -> Tensor:
    """One token id per row: sorted_logits [B, V] (temperature applied, descending), sorted_ids [B, V]
    int64 (the vocab id at each rank), top_ks [B] int64, top_ps / min_ps [B] float32, seeds / positions
    [B] int64 -> [B] int64.

    Gumbel-max in sorted space; the noise is keyed by vocab id, so sort order does not matter. log p
    differs from the logits by a per-row constant, which does not move the argmax, and masking with
    -inf is the renormalisation over the kept set."""
    keep = keep_mask_sorted(sorted_logits, top_ks, top_ps, min_ps)  # [B, V] bool
    noise = gumbel_noise(seeds, positions, sorted_ids)  # [B, V]
    scores = torch.where(keep, sorted_logits.to(torch.float32) + noise, float("-inf"))  # [B, V]
    choice_rank = torch.argmax(scores, dim=-1, keepdim=True)  # [B, 1]
    return sorted_ids.gather(1, choice_rank).squeeze(1)  # [B]
