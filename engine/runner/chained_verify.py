"""Chained TARGET_VERIFY rows: verify steps that overlap (n-gram drafts, overlap scheduling on).

The scheduler builds a request's next verify step while its last one still runs, so it knows neither
how many drafts that step keeps nor the tokens after them. It sends the row as if every draft were
kept (start, positions, seq_len and KV slots of that case, which it has reserved) with every input id
-1, and the engine resolves the row on the device from the previous step's result:
- the row's start is ``fill_len - 1`` of the slot (``SlotState.fill_len``, written by the previous
  verify step's acceptance), so its positions and seq_len move back by the drafts not kept, and its
  KV slots are read back from the slot table at those positions;
- its first id is the slot's ``last_token`` (as any placeholder), its drafts are prompt lookup
  (``kernels.chain_verify.ngram_drafts``) over the slot's tokens on the device.
No step waits for the device, so the host prepares step N+1 while step N runs, as for decoding.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..forward_batch import ForwardBatch
from ..forward_mode import ForwardMode
from ..request import PLACEHOLDER
from ...kernels.chain_verify import chain_verify_rows
from .host_io import upload
from .slot_state import SlotState

ChainVerifyRows = Callable[..., None]  # kernels.chain_verify.chain_verify_rows's contract


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


class ChainedVerify:
    """Resolves a step's chained rows in place (see the module doc), before its tokens are recorded."""

    def __init__(self, slots: SlotState, min_n: int, max_n: int, op: ChainVerifyRows = chain_verify_rows) -> None:
        """``op``: ``kernels.chain_verify.chain_verify_rows`` or a kernel of its contract."""
        self.slots = slots
        self.min_n, self.max_n = min_n, max_n
        self._op = op

    def resolve(self, batch: ForwardBatch, chained: np.ndarray, positions: torch.Tensor, seq_lens: torch.Tensor,
                out_cache_loc: torch.Tensor, input_ids: torch.Tensor) -> np.ndarray:
        """Move the ``chained`` rows ([B] bool) of ``batch`` from the all-kept case to where the previous
        step left them and draft them: ``positions``, ``out_cache_loc``, ``input_ids`` [T] and ``seq_lens``
        [B] in place. Returns the token index of each row's start ([B] host), with which
        ``host_prefix_lens`` reads where the rows went."""
        rows = np.flatnonzero(chained)
        queries = int(batch.extend_lens[rows[0]])  # k + 1, every chained row
        starts = np.cumsum(batch.extend_lens) - batch.extend_lens
        idx = starts[rows][:, None] + np.arange(queries)
        slots_d, rows_d, idx_d = upload([batch.req_pool_indices[rows], rows, idx], positions.device)
        s = self.slots
        self._op(s.req_to_token, s.token_ids, s.last_token, s.fill_len, slots_d, rows_d, idx_d, positions, seq_lens,
                 out_cache_loc, input_ids, int(batch.seq_lens.max()), self.min_n, self.max_n)
        return starts


def host_prefix_lens(batch: ForwardBatch, starts: np.ndarray, positions: torch.Tensor) -> list[int]:
    """Each row's prefix length after ``ChainedVerify.resolve`` (its first position), read from the device
    (a wait for it): for attention backends that plan on the host."""
    return positions[torch.from_numpy(starts).to(positions.device)].cpu().tolist()
