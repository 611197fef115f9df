"""The project's own Triton attention over the paged KV cache (CUDA; Triton's interpreter in tests).

DECODE (every ``extend_len`` 1) runs the split-K decode kernel, and so does TARGET_VERIFY when every
request brings the same number of queries (its last token and k drafts: the kernel's several-query
form, each key read once a request); EXTEND, MIXED and uneven verify steps the extend kernel (decode
rows of a MIXED batch are rows with one query). Both read KV slots through ``req_to_token``
at token granularity, so any page size works, and both take their loop bounds from device memory:
``init_forward_metadata`` only copies a few [B] host lists to the device, with no sync and no plan.

CUDA graphs (decode, and TARGET_VERIFY's k + 1 queries a request through the decode kernel): the
graph reads the rows from the runner's static buffers (``GraphInputs``, filled before each replay)
and the engine's slot table, whose address it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from .base import AttentionBackend, AttentionInputs, GraphInputs
from .kv_cache import KVCache
from ..triton.attention_decode import DecodeRotary, DecodeTiles, decode_attention
from ..triton.attention_extend import extend_attention


@dataclass(frozen=True)
class _DecodeMeta:
    req_to_token: torch.Tensor  # [max_reqs, max_context] int64 (device)
    req_pool_indices: torch.Tensor  # [B] (device)
    seq_lens: torch.Tensor  # [B] (device)
    queries: int = 1  # query tokens a request (a verify step's k + 1, a DLLM step's block)
    whole_row: bool = False  # they see each other (a DLLM block), not causally


@dataclass(frozen=True)
class _ExtendMeta:
    req_to_token: torch.Tensor  # [max_reqs, max_context] int64 (device)
    req_pool_indices: torch.Tensor  # [B] (device)
    qo_start: torch.Tensor  # [B] int32 (device): first query row of each request
    prefix_lens: torch.Tensor  # [B] int32 (device)
    extend_lens: torch.Tensor  # [B] int32 (device)
    max_extend_len: int
    block: int = 0  # > 0: block-causal (DLLM_EXTEND)


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, kv_cache: KVCache, num_heads: int, scale: float, sliding_window: int | None,
                 num_kv_splits: int | None = None, decode_tiles: DecodeTiles | None = None) -> None:
        """``num_kv_splits``: decode splits per (request, kv head); None: ``default_num_kv_splits``.
        ``decode_tiles``: the decode kernel's launch shape; None: ``default_decode_tiles`` (by splits)."""
        super().__init__(kv_cache, num_heads, scale, sliding_window)
        self._num_kv_splits = num_kv_splits
        self._decode_tiles = decode_tiles
        self._device = kv_cache.k[0].device
        self._meta: _DecodeMeta | _ExtendMeta | None = None
        # (bucket, queries a request) -> its static rows, KV slots
        self._graph_rows: dict[tuple[int, int], tuple[_DecodeMeta | _ExtendMeta, torch.Tensor]] = {}
        # the decode kernel's per-(row, kv head) slice counters, zero between launches: one buffer for
        # eager steps and graphs, grown outside capture (``_reserve_counters``); a grown-out buffer
        # stays alive, as graphs captured before keep its address
        self._counters = torch.zeros(0, dtype=torch.int32, device=self._device)
        self._old_counters: list[torch.Tensor] = []

    def _reserve_counters(self, rows: int) -> None:
        need = rows * self.kv_cache.num_kv_heads
        if self._counters.numel() < need:
            self._old_counters.append(self._counters)
            self._counters = torch.zeros(need, dtype=torch.int32, device=self._device)

    def init_forward_metadata(self, inputs: AttentionInputs) -> None:
        self._out_cache_loc = inputs.out_cache_loc
        extend_lens = inputs.extend_lens_cpu
        queries = inputs.uniform_queries
        if queries:
            self._reserve_counters(len(extend_lens))
            self._meta = _DecodeMeta(inputs.req_to_token, inputs.req_pool_indices, inputs.seq_lens, queries,
                                     inputs.block_size > 0)
            return
        qo_start = [0] * len(extend_lens)
        for i in range(1, len(extend_lens)):
            qo_start[i] = qo_start[i - 1] + extend_lens[i - 1]
        host = torch.tensor([qo_start, inputs.prefix_lens_cpu, extend_lens], dtype=torch.int32)  # [3, B]
        dev = host.to(self._device, non_blocking=True)
        self._meta = _ExtendMeta(inputs.req_to_token, inputs.req_pool_indices, dev[0], dev[1], dev[2],
                                 max(extend_lens), inputs.block_size)

    def reads_lengths_on_device(self, inputs: AttentionInputs) -> bool:
        return inputs.uniform_queries > 0  # the decode kernel, eager or in graphs: seq_lens on the device

    # ---- CUDA graphs (decode) -----------------------------------------------------------------
    supports_cuda_graph = True

    def init_capture(self, bs: int, static: GraphInputs) -> None:
        """Decode (or verify) over ``static``'s rows and slot table (during capture: padding rows, slot
        table row 0). A verify graph's query starts and lengths are fixed: ``tokens_per_row`` each."""
        q = static.tokens_per_row
        self._reserve_counters(bs)
        meta = _DecodeMeta(static.req_to_token, static.req_pool_indices, static.seq_lens, q, static.whole_row)
        self._graph_rows[bs, q] = (meta, static.out_cache_loc)
        self._meta, self._out_cache_loc = meta, static.out_cache_loc

    def init_replay(self, inputs: AttentionInputs, bs: int) -> None:
        """The rows are in the static buffers already; the graph reads the table it was captured with."""
        q = 1 if inputs.one_token_per_row else inputs.extend_lens_cpu[0]
        meta, self._out_cache_loc = self._graph_rows[bs, q]
        if inputs.req_to_token is not meta.req_to_token:
            raise ValueError("a decode graph replays over the slot table it was captured with")
        self._meta = meta

    def forward_decode_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                              cos_sin: torch.Tensor, layer_id: int) -> torch.Tensor | None:
        if not isinstance(self._meta, _DecodeMeta) or self._meta.queries > 1:
            return None  # a verify step's queries read each other's keys: stored first
        return self._decode(q, layer_id, self._meta, DecodeRotary(k, v, positions, cos_sin, self._out_cache_loc))

    def _decode(self, q: torch.Tensor, layer_id: int, meta: _DecodeMeta,
                rotary: DecodeRotary | None = None) -> torch.Tensor:
        return decode_attention(q, self.kv_cache.k[layer_id], self.kv_cache.v[layer_id], meta.req_to_token,
                                meta.req_pool_indices, meta.seq_lens, self.scale, self.sliding_window,
                                self._num_kv_splits, self._counters, rotary, self._decode_tiles, meta.queries,
                                meta.whole_row)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False) -> torch.Tensor:
        # q: [T, Hq, D], k/v: [T, Hkv, D]
        if not kv_stored:
            self.kv_cache.write(layer_id, self._out_cache_loc, k, v)
        k_cache, v_cache = self.kv_cache.k[layer_id], self.kv_cache.v[layer_id]
        meta = self._meta
        if isinstance(meta, _DecodeMeta):
            return self._decode(q, layer_id, meta)
        if isinstance(meta, _ExtendMeta):
            return extend_attention(q, k_cache, v_cache, meta.req_to_token, meta.req_pool_indices, meta.qo_start,
                                    meta.prefix_lens, meta.extend_lens, meta.max_extend_len, self.scale,
                                    self.sliding_window, meta.block)
        raise RuntimeError("init_forward_metadata (or init_replay) must run before forward")
