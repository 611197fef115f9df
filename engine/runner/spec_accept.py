"""The accept/reject decision of a TARGET_VERIFY step, on the device without a host sync.

Each request brings k draft tokens; the target scored k + 1 positions (its distribution after each
draft prefix). The output of a request is its accepted drafts plus one token of the target's: the
correction at the first rejected position, or the bonus token after k accepted ones. ``accepted`` is
how many drafts were kept, and ``tokens[:, :accepted + 1]`` is what the request emits.

- Greedy: a draft is kept while it equals the target's argmax.
- Sampled: rejection sampling, which leaves the output distributed exactly as the target's. A draft
  d with draft probability q(d) is kept with probability min(1, p(d) / q(d)); at the first rejection
  the token is drawn from max(0, p − q) renormalised; after k kept, from p. Every random number is a
  pure function of (seed, position) (``kernels.sampling``'s keyed noise), so a seeded request gets
  the same tokens whatever else is in the batch.
- One-hot drafts (``draft_probs`` None: n-gram) are the case q = one-hot(d): keeping d with
  probability p(d), and otherwise drawing from p without d, is what "the target's own seeded
  Gumbel-max draw equals d" does. So the output is token for token the non-speculative sampler's.

These are torch references: the noise is materialised as [B, k + 1, V] (at a 128k vocabulary and
batch 64, k = 4, about 160 MB a step). A fused kernel, as ``kernels.sampling`` has for the plain
draw, must match them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...kernels.sampling import gumbel_noise, hash32, row_keys

ACCEPT_SALT = 0x27D4EB2F  # the acceptance test's uniform draws, apart from the Gumbel noise's


def accepted_lengths(kept: Tensor) -> Tensor:
    """[B, k] bool, draft i kept on its own -> [B] int64: how many lead drafts are all kept."""
    return kept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def accept_greedy(draft_ids: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """draft_ids [B, k] int64, target_logits [B, k + 1, V] -> (accepted [B], tokens [B, k + 1])."""
    tokens = target_logits.argmax(dim=-1)
    return accepted_lengths(draft_ids == tokens[:, :-1]), tokens


def _gumbel(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """[B, P] seeds and positions -> [B, P, V] standard Gumbel noise keyed by (seed, position, id)."""
    b, p = positions.shape
    ids = torch.arange(vocab, device=positions.device).expand(b * p, vocab)
    return gumbel_noise(seeds.repeat_interleave(p), positions.reshape(-1), ids).reshape(b, p, vocab)


def _uniform(seeds: Tensor, positions: Tensor) -> Tensor:
    """[B, P] -> [B, P] uniform in (0, 1), keyed by (seed, position), independent of the Gumbel noise."""
    keys = row_keys(seeds.repeat_interleave(positions.shape[1]), positions.reshape(-1))
    x = hash32(keys ^ ACCEPT_SALT)
    return (((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).reshape(positions.shape)


def accept_sampled(draft_ids: Tensor, draft_probs: Tensor | None, target_probs: Tensor, seeds: Tensor,
                   positions: Tensor) -> tuple[Tensor, Tensor]:
    """Rejection sampling. draft_ids [B, k] int64; draft_probs [B, k, V] (None: one-hot drafts);
    target_probs [B, k + 1, V] (after temperature and filters); seeds [B] int64; positions [B, k + 1]
    int64, the sequence position each output token would take -> (accepted [B], tokens [B, k + 1])."""
    vocab = target_probs.shape[-1]
    noise = _gumbel(seeds, positions, vocab)
    sample = (target_probs.clamp_min(1e-30).log() + noise).argmax(dim=-1)  # the target's own draw
    if draft_probs is None:
        return accepted_lengths(draft_ids == sample[:, :-1]), sample
    k = draft_ids.shape[1]
    p = target_probs[:, :k].gather(2, draft_ids[:, :, None]).squeeze(2)
    q = draft_probs.gather(2, draft_ids[:, :, None]).squeeze(2)
    kept = _uniform(seeds, positions[:, :k]) * q < p  # u < min(1, p / q), without dividing by q = 0
    accepted = accepted_lengths(kept)
    residual = (target_probs[:, :k] - draft_probs).clamp_min(0.0)
    # where p <= q everywhere the residual is empty; then any token is as good (d is kept surely)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs[:, :k])
    corrected = (residual.clamp_min(1e-30).log() + noise[:, :k]).argmax(dim=-1)  # [B, k]
    rows = torch.arange(draft_ids.shape[0], device=draft_ids.device)
    tokens = torch.cat([draft_ids, sample[:, k:]], dim=1)  # kept drafts, then the bonus draw from p
    at = accepted.clamp_max(k - 1)
    fix = torch.where(accepted < k, corrected[rows, at], tokens[rows, at])
    tokens[rows, at] = fix  # the first rejected position takes the residual's draw
    return accepted, tokens
