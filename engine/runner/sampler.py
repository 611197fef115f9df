"""Batched, sync-free token sampling: penalties, temperature, top-k/top-p/min-p, seeded Gumbel-max.

Everything here is a pure function of tensors already on the logits' device plus a few Python flags
computed by the caller, so it never waits on the device (no ``.item()``, no data-dependent shapes).

Filter semantics (Hugging Face / vLLM order): ``logits / temperature`` -> softmax -> keep the ``top_k``
most probable tokens -> renormalise and keep the smallest prefix whose cumulative probability reaches
``top_p`` (the top token always stays) -> drop tokens whose probability is below ``min_p`` times the top
probability. All three masks are computed on one descending sort.

Sampling draws ``argmax(log p + g)`` over the kept tokens with Gumbel noise ``g`` that is a pure function
of ``(seed, position, vocab index)``: a seeded request therefore yields the same token whatever else is
in the batch, in whatever order, and again when it is recomputed after preemption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # 2**32 / golden ratio: decorrelates the inputs before each hash round
_SALT_POS = 0x85EBCA6B
_SALT_IDX = 0xC2B2AE35


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for the requests that sample this step, on the logits' device."""

    temperatures: Tensor  # [B] float32, 0 means greedy for that row
    top_ps: Tensor  # [B] float32 in (0, 1]
    top_ks: Tensor  # [B] int64, <= 0 means disabled
    min_ps: Tensor  # [B] float32 in [0, 1]
    seeds: Tensor  # [B] int64, a 64-bit seed reinterpreted as signed
    positions: Tensor  # [B] int64, sequence position of the token being sampled
    frequency_penalties: Tensor  # [B] float32, OpenAI: minus freq * count among generated tokens
    presence_penalties: Tensor  # [B] float32, OpenAI: minus pres if seen among generated tokens
    repetition_penalties: Tensor  # [B] float32, HF/CTRL over prompt and generated tokens
    any_penalties: bool  # skip penalty work entirely when False
    all_greedy: bool  # fast path: argmax only
    max_top_n: int  # top logprobs requested (max over rows; 0 = none)


class LogprobsResult(NamedTuple):
    chosen: Tensor  # [B] float32, log-probability of the sampled token
    top_ids: Tensor  # [B, top_n] int64, most probable token ids, descending
    top_values: Tensor  # [B, top_n] float32, their log-probabilities


# ---------------------------------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------------------------------


def apply_penalties(
    logits: Tensor, token_ids: Tensor, prompt_lens: Tensor, seq_lens: Tensor, st: SamplingTensors
) -> Tensor:
    """Repetition (prompt + generated), then frequency and presence (generated only) penalties.

    ``token_ids[b, :seq_lens[b]]`` is request ``b``'s prompt followed by its generated tokens; whatever
    lies beyond ``seq_lens[b]`` is ignored. Returns float32 logits; returns ``logits`` unchanged when
    ``st.any_penalties`` is False.
    """
    if not st.any_penalties:
        return logits
    batch, vocab = logits.shape  # logits: [B, V]
    device = logits.device
    cols = torch.arange(token_ids.shape[1], device=device)  # [L]
    valid = cols[None, :] < seq_lens[:, None]  # [B, L] bool
    generated = valid & (cols[None, :] >= prompt_lens[:, None])  # [B, L] bool
    ids = torch.where(valid, token_ids, torch.zeros_like(token_ids))  # [B, L]; padding -> 0, weight 0
    # Ids outside [0, V) cannot be produced by this head: send them to 0 with weight 0 as well.
    in_vocab = (ids >= 0) & (ids < vocab)  # [B, L]
    ids = torch.where(in_vocab, ids, torch.zeros_like(ids))  # [B, L]
    valid = valid & in_vocab
    generated = generated & in_vocab

    seen_counts = torch.zeros(batch, vocab, dtype=torch.float32, device=device)  # [B, V]
    seen_counts.scatter_add_(1, ids, valid.to(torch.float32))
    gen_counts = torch.zeros(batch, vocab, dtype=torch.float32, device=device)  # [B, V]
    gen_counts.scatter_add_(1, ids, generated.to(torch.float32))

    out = logits.to(torch.float32)  # [B, V]
    rep = st.repetition_penalties.to(torch.float32)[:, None]  # [B, 1]
    penalised = torch.where(out > 0, out / rep, out * rep)  # [B, V]
    out = torch.where(seen_counts > 0, penalised, out)  # [B, V]
    out = out - st.frequency_penalties.to(torch.float32)[:, None] * gen_counts  # [B, V]
    out = out - st.presence_penalties.to(torch.float32)[:, None] * (gen_counts > 0).to(torch.float32)
    return out


# ---------------------------------------------------------------------------------------------------
# Counter-based noise
# ---------------------------------------------------------------------------------------------------


def _hash32(x: Tensor) -> Tensor:
    """lowbias32 avalanche hash of uint32 values held in int64 (any shape -> same shape, in [0, 2**32))."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32  # int64 wrap-around only touches bits above 32, masked away
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    x = x ^ (x >> 16)
    return x


def _row_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """One 32-bit stream key per (seed, position): [B] int64 -> [B] int64 in [0, 2**32)."""
    seed_lo = seeds & _MASK32  # [B]
    seed_hi = (seeds >> 32) & _MASK32  # [B]; arithmetic shift, then mask = the raw high word
    key = _hash32(seed_lo ^ _GOLDEN32)  # [B]
    key = _hash32(key ^ seed_hi)  # [B]
    key = _hash32((key + _SALT_POS) ^ (positions & _MASK32))  # [B]
    return _hash32(key ^ ((positions >> 32) & _MASK32) ^ _SALT_IDX)  # [B]


def gumbel_noise(seeds: Tensor, positions: Tensor, vocab_ids: Tensor, vocab_size: int) -> Tensor:
    """Standard Gumbel noise, a pure function of (seed, position, vocab id).

    seeds, positions: [B] int64; vocab_ids: [B, N] int64 in [0, vocab_size), any order -> [B, N] float32.
    """
    keys = _row_keys(seeds, positions)  # [B]
    id_table = torch.arange(vocab_size, dtype=torch.int64, device=vocab_ids.device)  # [V]
    id_table = _hash32(id_table * _GOLDEN32 + _SALT_IDX)  # [V]; hashed once, gathered per row
    x = _hash32(keys[:, None] ^ id_table[vocab_ids])  # [B, N] in [0, 2**32)
    # Top 24 bits -> u strictly inside (0, 1), exactly representable in float32.
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # [B, N]
    return -torch.log(-torch.log(u))  # [B, N]


# ---------------------------------------------------------------------------------------------------
# Filtering and sampling
# ---------------------------------------------------------------------------------------------------


def _keep_mask_sorted(sorted_logits: Tensor, st: SamplingTensors) -> Tensor:
    """Which ranks survive top-k, top-p and min-p. sorted_logits: [B, V] descending -> [B, V] bool."""
    vocab = sorted_logits.shape[1]
    probs = torch.softmax(sorted_logits, dim=-1)  # [B, V] descending
    ranks = torch.arange(vocab, device=sorted_logits.device)  # [V]

    top_ks = torch.where(st.top_ks <= 0, torch.full_like(st.top_ks, vocab), st.top_ks.clamp(max=vocab))  # [B]
    keep = ranks[None, :] < top_ks[:, None]  # [B, V]

    # Top-p on the top-k renormalised distribution. The top-k set is a prefix, so the plain cumsum is
    # the masked cumsum inside it and the kept mass is the cumsum at rank k - 1.
    cumsum = torch.cumsum(probs, dim=-1)  # [B, V]
    topk_mass = cumsum.gather(1, (top_ks - 1)[:, None])  # [B, 1]
    exclusive = cumsum - probs  # [B, V]; mass strictly above each rank
    top_ps = st.top_ps.to(torch.float32)[:, None]  # [B, 1]
    keep_p = (exclusive < top_ps * topk_mass) | (top_ps >= 1.0)  # top_p == 1 never drops a rounding tail
    keep = keep & keep_p

    # Min-p: ratios to the top probability do not change under renormalisation.
    keep = keep & (probs >= st.min_ps.to(torch.float32)[:, None] * probs[:, :1])  # [B, V]
    keep[:, 0] = True  # the most probable token always stays
    return keep


def sample(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Next token ids [B] int64 from (already penalised) logits [B, V]."""
    logits = logits.to(torch.float32)  # [B, V]
    greedy_ids = torch.argmax(logits, dim=-1)  # [B]
    if st.all_greedy:
        return greedy_ids

    is_greedy = st.temperatures <= 0  # [B]
    temps = torch.where(is_greedy, torch.ones_like(st.temperatures), st.temperatures).to(torch.float32)  # [B]
    scaled = logits / temps[:, None]  # [B, V]
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True)  # [B, V], [B, V]
    keep = _keep_mask_sorted(sorted_logits, st)  # [B, V] bool

    # Gumbel-max in sorted space; the noise is keyed by vocab id, so sort order does not matter.
    # log p differs from the scaled logits by a per-row constant, which does not move the argmax,
    # and masking with -inf is the renormalisation over the kept set.
    noise = gumbel_noise(st.seeds, st.positions, sorted_ids, sorted_ids.shape[1])  # [B, V]
    scores = torch.where(keep, sorted_logits + noise, torch.full_like(sorted_logits, float("-inf")))  # [B, V]
    choice_rank = torch.argmax(scores, dim=-1, keepdim=True)  # [B, 1]
    sampled_ids = sorted_ids.gather(1, choice_rank).squeeze(1)  # [B]
    return torch.where(is_greedy, greedy_ids, sampled_ids)  # [B]


# ---------------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------------


def compute_logprobs(logits: Tensor, next_ids: Tensor, top_n: int) -> LogprobsResult:
    """Log-probabilities under the raw model distribution (before penalties and temperature).

    logits: [B, V] raw model logits; next_ids: [B] int64; top_n: Python int >= 0.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [B, V]
    chosen = logprobs.gather(1, next_ids[:, None].to(torch.int64)).squeeze(1)  # [B]
    top_values, top_ids = torch.topk(logprobs, top_n, dim=-1)  # [B, top_n], [B, top_n]
    return LogprobsResult(chosen=chosen, top_ids=top_ids, top_values=top_values)
