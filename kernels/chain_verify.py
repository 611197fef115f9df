"""Chained TARGET_VERIFY rows resolved on the device, as a torch reference (``kernels.triton.chain_verify``
is the one-launch kernel of the same contract); ``engine.runner.chained_verify`` says what a chained
row is and when the engine meets one."""

from __future__ import annotations

import torch


def ngram_drafts(tokens: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int) -> torch.Tensor:
    """[R, k] drafts by prompt lookup: for row r with known tokens ``tokens[r, :lengths[r]]``, the tokens
    after the latest earlier occurrence of its last n tokens (the longest n from ``max_n`` down to
    ``min_n`` that recurs), as ``engine.scheduler.ngram.propose_ngram`` finds them; where they run past
    the row's last token, or nothing recurs, the last token repeated (as the scheduler fills short
    proposals). tokens: [R, L] int64, lengths: [R] int64 (>= 1)."""
    rows, width = tokens.shape
    device = tokens.device
    lengths = lengths.clamp(1, width)
    last = lengths - 1  # [R]
    after = torch.full((rows,), -1, dtype=torch.int64, device=device)  # where the match's next token is
    for n in range(min_n, max_n + 1):  # longer suffixes override shorter ones
        if n >= width:
            break
        offsets = torch.arange(n, device=device)
        suffix = tokens.gather(1, (lengths[:, None] - n + offsets).clamp(min=0))  # [R, n]
        windows = tokens.unfold(1, n, 1)  # [R, width - n + 1, n]: windows by start
        starts = torch.arange(windows.shape[1], device=device)
        # a window inside tokens[:length - 1] (it ends before the last token), of a row long enough
        valid = (starts[None, :] + n <= last[:, None]) & (lengths[:, None] > n)
        hit = (windows == suffix[:, None, :]).all(-1) & valid
        latest = torch.where(hit, starts[None, :], -1).amax(1)  # [R]
        after = torch.where(latest >= 0, latest + n, after)
    at = torch.where(after[:, None] >= 0, after[:, None] + torch.arange(k, device=device), last[:, None])
    return tokens.gather(1, torch.minimum(at, last[:, None]))


def chain_verify_rows(req_to_token: torch.Tensor, token_ids: torch.Tensor, last_token: torch.Tensor,
                      fill_len: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                      positions: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                      input_ids: torch.Tensor, width: int, min_n: int, max_n: int) -> None:
    """Resolve C chained verify rows of a step in place. slots/rows: [C] each row's slot and batch row;
    tokens: [C, q] its tokens' indices into the step's [T] ``positions``, ``out_cache_loc`` and
    ``input_ids``; ``seq_lens``: [B]; the tables [max_reqs, max_context]; last_token/fill_len: [max_reqs].
    ``width``: a bound on any row's seq_len. All int64.

    A row arrives as the all-drafts-kept case: its positions and KV slots (reserved) that far on. Its
    slots are written into ``req_to_token`` there; the row then starts at ``fill_len[slot] - 1``
    (clamped into the table: a batch that chains a slot with no verify step before stays in bounds;
    positions from there, ``seq_lens`` less the shift, KV slots read back from the table); its first id
    is ``last_token[slot]`` and its q - 1 drafts are ``ngram_drafts`` over the slot's tokens up to and
    with that first id. The step's ``record_tokens`` runs after."""
    q = tokens.shape[1]
    pos = positions[tokens]  # [C, q]
    req_to_token[slots[:, None], pos] = out_cache_loc[tokens]
    start = (fill_len[slots] - 1).clamp(0, req_to_token.shape[1] - q)  # inside the table, whatever a batch says
    back = pos[:, 0] - start
    pos = start[:, None] + torch.arange(q, device=pos.device)
    positions[tokens] = pos
    seq_lens[rows] -= back
    out_cache_loc[tokens] = req_to_token[slots[:, None], pos]
    first = last_token[slots]
    width = min(width, int(token_ids.shape[1]))
    history = token_ids[slots, :width].clone()
    history.scatter_(1, start[:, None].clamp(max=width - 1), first[:, None])
    input_ids[tokens[:, 0]] = first
    input_ids[tokens[:, 1:]] = ngram_drafts(history, start + 1, q - 1, min_n, max_n)
