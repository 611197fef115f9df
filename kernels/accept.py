"""The greedy (one-hot draft) acceptance of a TARGET_VERIFY step over its flat tokens, as the torch
reference of ``kernels.triton.accept`` (same contract): request b's run of tokens (its last token, then
its drafts) is ``[starts[b], starts[b] + lens[b])``, and ``sampled`` holds the target's token after each.
Draft j of a run is kept while every draft up to it equals the target's token before it. For each
request: how many drafts it keeps, the token after them (the target's) into ``last_token[slot]``, and
where a chained next step starts (``positions[start] + kept + 2``) into ``fill_len[slot]``."""

from __future__ import annotations

import torch
from torch import Tensor


def accept_runs(sampled: Tensor, input_ids: Tensor, positions: Tensor, starts: Tensor, lens: Tensor, slots: Tensor,
                last_token: Tensor, fill_len: Tensor, max_len: int) -> Tensor:
    """-> [B] int64, the drafts each request keeps. ``max_len``: at least the longest run (unused here)."""
    t, b = sampled.shape[0], starts.shape[0]
    runs = torch.repeat_interleave(torch.arange(b, device=sampled.device), lens, output_size=t)
    idx = torch.arange(t, device=sampled.device)
    same_run = torch.zeros(t, dtype=torch.bool, device=sampled.device)
    same_run[:-1] = runs[1:] == runs[:-1]
    confirms = torch.zeros_like(same_run)
    confirms[:-1] = sampled[:-1] == input_ids[1:]
    first_miss = torch.full_like(starts, t).scatter_reduce(0, runs, torch.where(same_run & confirms, t, idx), "amin")
    accepted = first_miss - starts
    last_token[slots] = sampled[starts + accepted]
    fill_len[slots] = positions[starts] + accepted + 2
    return accepted
