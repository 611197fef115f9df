"""Chained TARGET_VERIFY rows: verify steps that overlap (n-gram drafts, overlap scheduling on).

The scheduler builds a request's next verify step while its last one still runs, so it knows neither
how many drafts that step keeps nor the tokens after them. It sends the row as if every draft were
kept (start, positions, seq_len and KV slots of that case, which it has reserved) with every input id
-1, and the engine resolves the row on the device from the previous step's result:
- the row's start is ``fill_len - 1`` of the slot (``SlotState.fill_len``, written by the previous
  verify step's acceptance), so its positions and seq_len move back by the drafts not kept, and its
  KV slots are read back from the slot table at those positions;
- its first id is the slot's ``last_token`` (as any placeholder), its drafts are prompt lookup
  (``ngram_drafts``) over the slot's tokens on the device.
No step waits for the device, so the host prepares step N+1 while step N runs, as for decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..forward_batch import ForwardBatch
from ..forward_mode import ForwardMode
from .host_io import upload
from .slot_state import SlotState

PLACEHOLDER = -1


def chained_rows(batch: ForwardBatch) -> np.ndarray | None:
    """[B] bool: the rows of a TARGET_VERIFY step whose drafts the engine makes (their first draft id is
    -1); None when there is none (other steps, or no chained row)."""
    if batch.forward_mode != ForwardMode.TARGET_VERIFY or not batch.batch_size:
        return None
    starts = np.cumsum(batch.extend_lens) - batch.extend_lens
    has_draft = batch.extend_lens > 1
    chained = np.zeros(batch.batch_size, dtype=bool)
    chained[has_draft] = batch.input_ids[starts[has_draft] + 1] == PLACEHOLDER
    return chained if chained.any() else None


def ngram_drafts(tokens: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int) -> torch.Tensor:
    """[R, k] drafts by prompt lookup, on the device: for row r with known tokens ``tokens[r, :lengths[r]]``,
    the tokens after the latest earlier occurrence of its last n tokens (the longest n from ``max_n``
    down to ``min_n`` that recurs), as ``scheduler.ngram.propose_ngram`` finds them; where they run past
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


@dataclass(frozen=True)
class ChainedRows:
    """A step's chained rows, on the device: their batch rows [C], their tokens' indices in the step
    [C, k + 1] and their slots [C]; ``back``: how far each moved back (``ChainedVerify.shift``)."""

    rows: torch.Tensor
    tokens: torch.Tensor
    slots: torch.Tensor
    back: torch.Tensor | None = None


class ChainedVerify:
    """Resolves a step's chained rows in place (see the module doc): ``shift`` before its tokens are
    recorded, ``draft`` after."""

    def __init__(self, slots: SlotState, min_n: int, max_n: int) -> None:
        self.slots = slots
        self.min_n, self.max_n = min_n, max_n

    def shift(self, batch: ForwardBatch, chained: np.ndarray, positions: torch.Tensor, seq_lens: torch.Tensor,
              out_cache_loc: torch.Tensor) -> ChainedRows:
        """Move the ``chained`` rows ([B] bool) of ``batch`` from the all-kept case to where the previous
        step left them: ``positions`` [T], ``seq_lens`` [B] and ``out_cache_loc`` [T] in place."""
        rows = np.flatnonzero(chained)
        queries = int(batch.extend_lens[rows[0]])  # k + 1, every chained row
        starts = (np.cumsum(batch.extend_lens) - batch.extend_lens)[rows]
        idx = starts[:, None] + np.arange(queries)
        rows_d, idx_d, slots_d = upload([rows, idx, batch.req_pool_indices[rows]], positions.device)
        table = self.slots.req_to_token
        pos = positions[idx_d]  # [C, q]
        table[slots_d[:, None], pos] = out_cache_loc[idx_d]  # the reserved slots the host sent
        back = pos[:, 0] - (self.slots.fill_len[slots_d] - 1)
        pos = pos - back[:, None]
        positions[idx_d] = pos
        seq_lens[rows_d] -= back
        out_cache_loc[idx_d] = table[slots_d[:, None], pos]
        return ChainedRows(rows_d, idx_d, slots_d, back)

    def draft(self, chained: ChainedRows, width: int, positions: torch.Tensor, input_ids: torch.Tensor) -> None:
        """The chained rows' drafts into ``input_ids`` [T] and the slots' token history, after the step's
        tokens were recorded (each row's first id resolved, at its start). ``width``: a bound on the
        rows' lengths (the batch's longest seq_len as sent)."""
        token_ids = self.slots.token_ids
        width = min(width, int(token_ids.shape[1]))
        pos = positions[chained.tokens]  # [C, q]
        # each row's known tokens end at its start, whose id the record resolved
        drafts = ngram_drafts(token_ids[chained.slots, :width], pos[:, 0] + 1, pos.shape[1] - 1, self.min_n,
                              self.max_n)
        input_ids[chained.tokens[:, 1:]] = drafts
        token_ids[chained.slots[:, None], pos[:, 1:]] = drafts
