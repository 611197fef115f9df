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
from host-known shapes; nothing waits for it but the next sub-step's attention plan, which waits
for the previous one's to have reached the device (FlashInfer's plan reuses one pinned host buffer
per wrapper). On CUDA the catch-up (two queries a request) and the DECODE sub-steps replay the
draft's own graphs, by batch bucket.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from ..config import RunnerConfig
from ..forward_batch import ForwardBatch
from ..forward_mode import ForwardMode
from ..models.loader import Checkpoint, load_model
from .cuda_graph_runner import CudaGraphRunner
from .host_io import upload
from .slot_state import SlotState
from ...kernels.attention.base import CATCH_UP_QUERIES, AttentionInputs, create_attention_backend, resolve_backend_name
from ...kernels.attention.flashinfer_triton_backend import TRITON_DECODE_MAX_ROWS
from ...kernels.attention.kv_cache import KVCache
from ...kernels.op_set import KernelOps


class DraftModel:
    def __init__(self, ckpt: Checkpoint, cfg: RunnerConfig, dtype: torch.dtype, device: torch.device,
                 num_slots: int, max_context: int, ops: KernelOps, slot_table: torch.Tensor,
                 graph_max_bs: int = 0) -> None:
        """``slot_table``: the target's req_to_token (its slots are the draft's too); ``graph_max_bs``:
        DECODE graphs up to this batch size (0: eager)."""
        mc = ckpt.config
        self.device = device
        self.model = load_model(ckpt, dtype, device, max_context, None, ops)
        self.kv_cache = KVCache(mc.num_layers, num_slots, mc.num_kv_heads, mc.head_dim, cfg.page_size, dtype, device,
                                ops.store_kv)
        self.backend_name = resolve_backend_name(cfg.attention_backend, device, dtype, mc.head_dim)
        self.attn = create_attention_backend(self.backend_name, device, dtype, kv_cache=self.kv_cache,
                                             num_heads=mc.num_heads, scale=1.0 / math.sqrt(mc.head_dim),
                                             sliding_window=mc.sliding_window)
        self.graphs: CudaGraphRunner | None = None  # DECODE sub-steps
        self.catch_up_graphs: CudaGraphRunner | None = None  # DRAFT_EXTEND of two tokens a request
        if graph_max_bs > 0 and self.attn.supports_cuda_graph:
            self.graphs = CudaGraphRunner(self.model, self.attn, graph_max_bs, device, slot_table)
            self.catch_up_graphs = CudaGraphRunner(self.model, self.attn, graph_max_bs, device, slot_table,
                                                   mode=ForwardMode.DRAFT_EXTEND, tokens_per_row=CATCH_UP_QUERIES)
        self._planned: torch.cuda.Event | None = None

    def extend(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs: AttentionInputs) -> None:
        """The draft's keys and values of a target EXTEND/MIXED step's tokens (DRAFT_EXTEND)."""
        self._plan(lambda: self.attn.init_forward_metadata(inputs), len(inputs.extend_lens_cpu))
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
        draft = self._catch_up(ids2, pos2, pos2_dev, loc2, req_pool, last, batch.req_pool_indices, slots)
        out = input_ids.clone()
        rows = np.arange(num)  # the requests whose next draft is in ``draft`` (in this order)
        for j in range(1, int(ext.max()) if num else 1):  # draft j of every request that has one
            keep = np.flatnonzero(ext[rows] > j)
            if len(keep) < len(rows):
                rows, (keep_dev,) = rows[keep], upload([keep], self.device)
                draft = draft[keep_dev]
            (at_dev,) = upload([starts[rows] + j], self.device)
            out[at_dev] = draft
            more = np.flatnonzero(ext[rows] > j + 1)  # room for draft j + 1: draft j in, at its own KV slot
            if not len(more):
                break
            if len(more) < len(rows):
                (more_dev,) = upload([more], self.device)
                rows, draft = rows[more], draft[more_dev]
            draft = self._decode(draft, last[rows] + j, batch.out_cache_loc[starts[rows] + j],
                                 batch.req_pool_indices[rows], slots)
        return out

    def _plan(self, plan: Callable[[], None], rows: int) -> None:
        """Run an attention plan; where the backend plans on the host into buffers it reuses (FlashInfer's
        decode, which plans each sub-step), once the previous plan's host-to-device copies have run."""
        reuses = self.backend_name == "flashinfer" or (self.backend_name == "flashinfer-triton"
                                                      and rows > TRITON_DECODE_MAX_ROWS)
        if self._planned is not None and reuses:
            self._planned.synchronize()
        plan()
        if self.device.type == "cuda":
            self._planned = torch.cuda.Event()
            self._planned.record()

    def _catch_up(self, ids: torch.Tensor, positions: np.ndarray, positions_dev: torch.Tensor, loc: torch.Tensor,
                  req_pool: torch.Tensor, last: np.ndarray, req_pool_cpu: np.ndarray, slots: SlotState) -> torch.Tensor:
        """DRAFT_EXTEND of each request's last two tokens -> the greedy token after the last: draft 1. A
        graph replay where a bucket fits (its ids and KV slots copied in on the device)."""
        n = len(last)
        graphs = self.catch_up_graphs
        bucket = graphs.bucket_for(ForwardMode.DRAFT_EXTEND, n) if graphs is not None else None
        if graphs is not None and bucket is not None:
            rows = graphs.upload(ForwardMode.DRAFT_EXTEND, bucket, [np.zeros(2 * n, dtype=np.int64), positions,
                                                                    np.zeros(2 * n, dtype=np.int64), req_pool_cpu,
                                                                    last + 1])
            rows.input_ids.copy_(ids)
            rows.out_cache_loc.copy_(loc)
            inputs = self._inputs(ForwardMode.DRAFT_EXTEND, rows.req_pool_indices, rows.seq_lens, rows.out_cache_loc,
                                  last - 1, req_pool_cpu, slots)
            self._plan(lambda: self.attn.init_replay(inputs, bucket), n)
            return graphs.replay(bucket, n)[1::2].argmax(-1)
        (seq_dev,) = upload([last + 1], self.device)
        inputs = self._inputs(ForwardMode.DRAFT_EXTEND, req_pool, seq_dev, loc, last - 1, req_pool_cpu, slots)
        self._plan(lambda: self.attn.init_forward_metadata(inputs), n)
        hidden = self.model(ids, positions_dev, self.attn)
        return self.model.compute_logits(hidden[1::2]).argmax(-1)

    def _inputs(self, mode: ForwardMode, req_pool: torch.Tensor, seq_lens: torch.Tensor, loc: torch.Tensor,
                prefix: np.ndarray, req_pool_cpu: np.ndarray, slots: SlotState) -> AttentionInputs:
        """A sub-step's attention inputs: the catch-up's (DRAFT_EXTEND, two tokens a request after
        ``prefix``) or a proposal's (DECODE, one)."""
        queries = CATCH_UP_QUERIES if mode == ForwardMode.DRAFT_EXTEND else 1
        return AttentionInputs(
            forward_mode=mode, req_pool_indices=req_pool, prefix_lens_cpu=prefix.tolist(),
            extend_lens_cpu=[queries] * len(prefix), seq_lens=seq_lens, out_cache_loc=loc,
            req_to_token=slots.req_to_token, dtype=self.kv_cache.dtype, req_pool_indices_cpu=req_pool_cpu,
            req_to_page_cpu=slots.req_to_page)

    def _decode(self, ids: torch.Tensor, positions: np.ndarray, loc: np.ndarray, req_pool_cpu: np.ndarray,
                slots: SlotState) -> torch.Tensor:
        """A DECODE sub-step: draft j (``ids``, on the device) in at ``positions`` and KV slots ``loc``
        (host) -> draft j + 1; a graph replay where a bucket fits."""
        n = len(positions)
        seq = positions + 1
        bucket = self.graphs.bucket_for(ForwardMode.DECODE, n) if self.graphs is not None else None
        if self.graphs is not None and bucket is not None:
            rows = self.graphs.upload(ForwardMode.DECODE, bucket, [np.zeros(n, dtype=np.int64), positions, loc,
                                                                   req_pool_cpu, seq])
            rows.input_ids.copy_(ids)
            inputs = self._inputs(ForwardMode.DECODE, rows.req_pool_indices, rows.seq_lens, rows.out_cache_loc,
                                  positions, req_pool_cpu, slots)
            self._plan(lambda: self.attn.init_replay(inputs, bucket), n)
            return self.graphs.replay(bucket, n).argmax(-1)
        pos_dev, loc_dev, pool_dev, seq_dev = upload([positions, loc, req_pool_cpu, seq], self.device)
        inputs = self._inputs(ForwardMode.DECODE, pool_dev, seq_dev, loc_dev, positions, req_pool_cpu, slots)
        self._plan(lambda: self.attn.init_forward_metadata(inputs), n)
        hidden = self.model(ids, pos_dev, self.attn)
        return self.model.compute_logits(hidden).argmax(-1)
