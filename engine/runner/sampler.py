"""Batched, sync-free token sampling: penalties, temperature, top-k/top-p/min-p, seeded Gumbel-max.

Everything here is a pure function of tensors already on the logits' device plus a few Python flags
computed by the caller, so it never waits on the device (no ``.item()``, no data-dependent shapes).

``logits / temperature`` is sorted descending once; the filters (top-k, then top-p on the renormalised
top-k set, then min-p) and the seeded Gumbel-max draw over what they keep are ``kernels.sampling``'s
step after the sort (its torch reference, or the fused Triton kernel on CUDA): a seeded request yields
the same token whatever else is in the batch, and again after preemption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ...kernels import sampling as kernel_sampling


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
# Sampling
# ---------------------------------------------------------------------------------------------------

def sample(logits: Tensor, st: SamplingTensors, sample_sorted: kernel_sampling.SampleSorted = kernel_sampling.sample_sorted) -> Tensor:
    """Next token ids [B] int64 from (already penalised) logits [B, V]. ``sample_sorted`` is the step
    after the sort (``kernels.sampling.sample_sorted`` or the fused Triton kernel of the same signature)."""
    logits = logits.to(torch.float32)  # [B, V]
    greedy_ids = torch.argmax(logits, dim=-1)  # [B]
    if st.all_greedy:
        return greedy_ids

    is_greedy = st.temperatures <= 0  # [B]
    temps = torch.where(is_greedy, torch.ones_like(st.temperatures), st.temperatures).to(torch.float32)  # [B]
    sorted_logits, sorted_ids = torch.sort(logits / temps[:, None], dim=-1, descending=True)  # [B, V], [B, V]
    sampled_ids = sample_sorted(sorted_logits, sorted_ids, st.top_ks, st.top_ps, st.min_ps, st.seeds, st.positions)
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
