"""The draft model of speculative decoding with ``speculative_algorithm="draft"``: a second model in the
engine process, beside the target, so that a TARGET_VERIFY step drafts and verifies in one launch (no
round trip per draft token to the scheduler, local or remote).

Its KV cache has the target's slots: the slot the scheduler gives a token holds both models' keys
and values, so the scheduler's allocator frees both, a rejected draft's included. The draft
computes a token's keys and values when the target does (DRAFT_EXTEND with every EXTEND and MIXED
step), and in a verify step:

- DRAFT_EXTEND (catch-up): the request's last two tokens, whose draft keys may be missing (the last
  token is new; the one before it too when every draft was kept); its greedy token is draft 1;
- DECODE steps: draft j in, draft j + 1 out, into the verify's own KV slots, for as many drafts as
  the scheduler reserved room for.

Drafts are the draft's argmax (a one-hot proposal): the target keeps a draft exactly when its own
draw equals it, which is rejection sampling for a one-hot proposal. Everything runs on the device
from host-known shapes; nothing waits for it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..config import RunnerConfig
from ..forward_batch import ForwardBatch
from ..forward_mode import ForwardMode
from ..models.loader import Checkpoint, load_model
from .host_io import upload
from .slot_state import SlotState
from ...kernels.attention.base import AttentionInputs, create_attention_backend, resolve_backend_name
from ...kernels.attention.kv_cache import KVCache
from ...kernels.op_set import KernelOps


class DraftModel:
    def __init__(self, ckpt: Checkpoint, cfg: RunnerConfig, dtype: torch.dtype, device: torch.device,
                 num_slots: int, max_context: int, ops: KernelOps) -> None:
        mc = ckpt.config
        self.device = device
        self.model = load_model(ckpt, dtype, device, max_context, None, ops)
        self.kv_cache = KVCache(mc.num_layers, num_slots, mc.num_kv_heads, mc.head_dim, cfg.page_size, dtype, device,
                                ops.store_kv)
        self.attn = create_attention_backend(resolve_backend_name(cfg.attention_backend, device, dtype, mc.head_dim),
                                             device, dtype, kv_cache=self.kv_cache, num_heads=mc.num_heads,
                                             scale=1.0 / math.sqrt(mc.head_dim), sliding_window=mc.sliding_window)

    def extend(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs: AttentionInputs) -> None:
        """The draft's keys and values of a target EXTEND/MIXED step's tokens (DRAFT_EXTEND)."""
        self.attn.init_forward_metadata(inputs)
        self.model(input_ids, positions, self.attn)

    def propose(self, batch: ForwardBatch, input_ids: torch.Tensor, out_cache_loc: torch.Tensor,
                req_pool: torch.Tensor, slots: SlotState) -> torch.Tensor:
        """The verify step's input ids with each request's drafts in place of its placeholders. The
        step's KV slots must be in ``slots.req_to_token`` already."""
        ext = batch.extend_lens
        last = batch.prefix_lens  # the position of each request's last token
        starts = np.cumsum(ext) - ext
        num = len(ext)
        pos2 = np.stack([last - 1, last], axis=1).reshape(-1)  # catch-up: the last two tokens a request
        last_dev, starts_dev, pos2_dev = upload([last, starts, pos2], self.device)
        ids2 = torch.stack([slots.token_ids[req_pool, last_dev - 1], input_ids[starts_dev]], dim=1).reshape(-1)
        loc2 = torch.stack([slots.req_to_token[req_pool, last_dev - 1], out_cache_loc[starts_dev]], dim=1).reshape(-1)
        draft = self._greedy(ForwardMode.DRAFT_EXTEND, ids2, pos2_dev, loc2, req_pool, last + 1,
                             last - 1, np.full(num, 2), batch.req_pool_indices, slots, sample=slice(1, None, 2))
        out = input_ids.clone()
        rows = np.arange(num)  # the requests whose next draft is in ``draft`` (in this order)
        for j in range(1, int(ext.max()) if num else 1):  # draft j of every request that has one
            keep = np.flatnonzero(ext[rows] > j)
            rows, (keep_dev, at_dev) = rows[keep], upload([keep, starts[rows[keep]] + j], self.device)
            draft = draft[keep_dev]
            out[at_dev] = draft
            more = np.flatnonzero(ext[rows] > j + 1)  # room for draft j + 1: draft j in, at its own KV slot
            if not len(more):
                break
            rows = rows[more]
            more_dev, loc_at, pos, rows_dev = upload([more, starts[rows] + j, last[rows] + j, rows], self.device)
            draft = self._greedy(ForwardMode.DECODE, draft[more_dev], pos, out_cache_loc[loc_at], req_pool[rows_dev],
                                 last[rows] + j + 1, last[rows] + j, np.ones(len(rows), dtype=np.int64),
                                 batch.req_pool_indices[rows], slots)
        return out

    def _greedy(self, mode: ForwardMode, ids: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor,
                req_pool: torch.Tensor, seq_lens: np.ndarray, prefix: np.ndarray, ext: np.ndarray,
                req_pool_cpu: np.ndarray, slots: SlotState, sample: slice = slice(None)) -> torch.Tensor:
        """The draft's greedy token after each ``sample`` row of ``ids`` (``prefix``/``ext``/``seq_lens``
        on the host, for the attention plan)."""
        (seq_dev,) = upload([seq_lens], self.device)
        self.attn.init_forward_metadata(AttentionInputs(
            forward_mode=mode, req_pool_indices=req_pool, prefix_lens_cpu=prefix.tolist(),
            extend_lens_cpu=ext.tolist(), seq_lens=seq_dev, out_cache_loc=loc,
            req_to_token=slots.req_to_token, dtype=self.kv_cache.dtype, req_pool_indices_cpu=req_pool_cpu,
            req_to_page_cpu=slots.req_to_page))
        hidden = self.model(ids, positions, self.attn)
        return self.model.compute_logits(hidden[sample]).argmax(-1)
