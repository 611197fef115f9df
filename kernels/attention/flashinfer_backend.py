"""FlashInfer attention over the paged KV cache (CUDA, fp16/bf16).

DECODE uses ``BatchDecodeWithPagedKVCacheWrapper``. A prefill with no cached prefix in any row
reads the step's own k/v (``BatchPrefillWithRaggedKVCacheWrapper``, causal); other EXTEND and MIXED
steps use one ``BatchPrefillWithPagedKVCacheWrapper`` over all rows (its causal mask is aligned to
the end of each request's KV, so decode rows of a MIXED batch are just rows with one query).
``plan`` runs once per step on host metadata, outside any CUDA graph.

The ragged kernel is used only without a cached prefix, where it beats the paged one and its plan
skips the page table; with a prefix, ragged for the new tokens plus paged for the prefix plus
``merge_state`` is slower than one paged call, so those steps stay paged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...engine.forward_mode import ForwardMode
from .base import AttentionBackend, AttentionInputs, GraphInputs
from .kv_cache import KVCache

WORKSPACE_BYTES = 256 * 2**20


def page_table(inputs: AttentionInputs, page_size: int, pad_to: int = 0,
               pad_len: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR page table of the batch, built on the host from the slot table's page mirror:
    (indptr [B+1] int32, indices [P] int32, last_page_len [B] int32). With ``pad_to`` > B, rows
    B..pad_to-1 are ``pad_len``-token rows on the reserved page 0 (padding of a CUDA-graph bucket)."""
    seq = np.asarray(inputs.seq_lens_cpu, dtype=np.int64)  # [B]
    num_pages = (seq + page_size - 1) // page_size  # [B]
    max_pages = int(num_pages.max()) if len(seq) else 0
    if inputs.req_to_page_cpu is not None and inputs.req_pool_indices_cpu is not None:
        table = inputs.req_to_page_cpu[inputs.req_pool_indices_cpu, :max_pages]  # [B, Pmax]
    else:  # a caller without host copies (kernel tests): read the device table, which waits for it
        rows = inputs.req_to_token[inputs.req_pool_indices, : max_pages * page_size : page_size]
        table = (rows // page_size).cpu().numpy()
    indices = table[np.arange(max_pages)[None, :] < num_pages[:, None]]  # [P], row-major = request order
    indptr = np.zeros(len(seq) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    last = (seq - (num_pages - 1) * page_size).astype(np.int32)
    indices = indices.astype(np.int32)
    pad = pad_to - len(seq)
    if pad > 0:
        pages = -(-pad_len // page_size)  # page 0 again and again: its slots are never read for real
        indptr = np.concatenate([indptr, indptr[-1] + pages * np.arange(1, pad + 1, dtype=np.int32)])
        indices = np.concatenate([indices, np.zeros(pad * pages, dtype=np.int32)])
        last = np.concatenate([last, np.full(pad, pad_len - (pages - 1) * page_size, dtype=np.int32)])
    return indptr, indices, last


def _no_rows(req_to_token: torch.Tensor) -> AttentionInputs:
    """A batch of no requests (a captured graph's plan pads it to padding only)."""
    empty = torch.zeros(0, dtype=torch.int64, device=req_to_token.device)
    return AttentionInputs(ForwardMode.DECODE, empty, [], [], empty, empty, req_to_token, torch.float32,
                           np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int32))


def _indptr(lens: list[int]) -> np.ndarray:
    """[len(lens) + 1] int32 offsets of rows of these lengths."""
    out = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=out[1:])
    return out


def _pinned(a: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.pin_memory() if torch.cuda.is_available() else t


def decode_uses_tensor_cores(group_size: int) -> bool:
    """Whether DECODE runs FlashInfer's tensor-core (prefill) kernel rather than its CUDA-core decode
    kernel: for query-head groups of 4 or more, where it is the faster one (``modeserve bench attention``)."""
    return group_size >= 4


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, kv_cache: KVCache, num_heads: int, scale: float, sliding_window: int | None,
                 decode_tensor_cores: bool | None = None) -> None:
        """``decode_tensor_cores``: None picks by the query-head group size (``decode_uses_tensor_cores``)."""
        super().__init__(kv_cache, num_heads, scale, sliding_window)
        import flashinfer  # optional dependency (CUDA hosts); importing this module must not need it

        device = kv_cache.k[0].device
        if decode_tensor_cores is None:
            decode_tensor_cores = decode_uses_tensor_cores(num_heads // kv_cache.num_kv_heads)
        self._tensor_cores = decode_tensor_cores
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # decode steps (eager and graphs) may run beside a split prefill's slices on another stream
        # (enable_split_prefill_overlap): their split-KV partials must not share the prefill wrappers' buffer
        self._decode_workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._decode_workspace, "NHD",
                                                                     use_tensor_cores=decode_tensor_cores)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD")
        self._window_left = sliding_window - 1 if sliding_window else -1
        self._wrapper: object = None
        # (batch-size bucket, queries a request) -> decode (1) or prefill (verify) wrapper with fixed buffers
        self._graph_wrappers: dict[tuple[int, int], object] = {}

    def init_forward_metadata(self, inputs: AttentionInputs) -> None:
        kv = self.kv_cache
        self._out_cache_loc = inputs.out_cache_loc
        decode = inputs.one_token_per_row
        heads = dict(num_qo_heads=self.num_heads, num_kv_heads=kv.num_kv_heads, window_left=self._window_left,
                     sm_scale=self.scale, q_data_type=inputs.dtype)
        if not decode and not any(inputs.prefix_lens_cpu):  # every row starts at position 0: ragged
            qo = _pinned(_indptr(inputs.extend_lens_cpu))
            self._ragged.plan(qo, qo, head_dim_qk=kv.head_dim, causal=True, kv_data_type=inputs.dtype, **heads)
            self._wrapper = self._ragged
            return
        indptr_np, indices_np, last_np = page_table(inputs, kv.page_size)
        indptr, last = _pinned(indptr_np), _pinned(last_np)
        indices = _pinned(indices_np).to(kv.k[0].device, non_blocking=True)
        paged = dict(heads, page_size=kv.page_size, kv_data_type=kv.dtype)
        if decode:
            self._decode.plan(indptr, indices, last, head_dim=kv.head_dim, **paged)
            self._wrapper = self._decode
        else:
            self._prefill.plan(_pinned(_indptr(inputs.extend_lens_cpu)), indptr, indices, last,
                               head_dim_qk=kv.head_dim, causal=True, **paged)
            self._wrapper = self._prefill

    # ---- CUDA graphs (decode; verify: k + 1 queries a request, FlashInfer's prefill kernel) ------------
    supports_cuda_graph = True

    def init_capture(self, bs: int, static: GraphInputs) -> None:
        """Make the wrapper for ``bs`` requests of ``static.tokens_per_row`` queries (fixed buffers), or
        take the one made before (a bucket captured again, on another stream, replays from the same
        plan), and plan a batch of padding only: every request on the reserved page 0."""
        kv, dev, q = self.kv_cache, self.kv_cache.k[0].device, static.tokens_per_row
        wrapper = self._graph_wrappers.get((bs, q)) or self._graph_wrapper(bs, q)
        self._graph_wrappers[bs, q] = wrapper
        indptr, indices, last = page_table(_no_rows(static.req_to_token), kv.page_size, pad_to=bs, pad_len=q)
        self._plan_graph(wrapper, q, _pinned(indptr), _pinned(indices).to(dev), _pinned(last))
        self._wrapper, self._out_cache_loc = wrapper, static.out_cache_loc

    def _graph_wrapper(self, bs: int, q: int) -> object:
        """A wrapper of fixed buffers for ``bs`` requests of ``q`` queries."""
        import flashinfer  # optional dependency (CUDA hosts); importing this module must not need it

        kv, dev = self.kv_cache, self.kv_cache.k[0].device
        indptr_buf = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        padding_pages = bs * -(-q // kv.page_size)  # beyond the pool's pages: a padded request's page-0 entries
        indices_buf = torch.zeros(kv.num_slots // kv.page_size + padding_pages, dtype=torch.int32, device=dev)
        last_buf = torch.zeros(bs, dtype=torch.int32, device=dev)
        wrapper: object
        if q == 1:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._decode_workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=indices_buf,
                paged_kv_last_page_len_buffer=last_buf)
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
                paged_kv_indptr_buf=indptr_buf, paged_kv_indices_buf=indices_buf, paged_kv_last_page_len_buf=last_buf)
        return wrapper

    def init_replay(self, inputs: AttentionInputs, bs: int) -> None:
        """Plan the real requests, padded to ``bs`` with requests on page 0."""
        q = inputs.extend_lens_cpu[0] if inputs.extend_lens_cpu else 1
        q = q if (bs, q) in self._graph_wrappers else 1  # an IDLE replay: padding only, in the decode graph
        indptr, indices, last = page_table(inputs, self.kv_cache.page_size, pad_to=bs, pad_len=q)
        wrapper = self._graph_wrappers[bs, q]
        self._plan_graph(wrapper, q, _pinned(indptr), _pinned(indices).to(self.kv_cache.k[0].device, non_blocking=True),
                         _pinned(last))
        self._wrapper = wrapper

    def _plan_graph(self, wrapper: object, q: int, indptr: torch.Tensor, indices: torch.Tensor,
                    last: torch.Tensor) -> None:
        if q == 1:
            self._plan_decode(wrapper, indptr, indices, last)
            return
        kv = self.kv_cache
        qo = _pinned(np.arange(len(last) + 1, dtype=np.int32) * q)
        wrapper.plan(qo, indptr, indices, last, num_qo_heads=self.num_heads,  # type: ignore[attr-defined]
                     num_kv_heads=kv.num_kv_heads, head_dim_qk=kv.head_dim, page_size=kv.page_size, causal=True,
                     window_left=self._window_left, sm_scale=self.scale, q_data_type=kv.dtype, kv_data_type=kv.dtype)

    def _plan_decode(self, wrapper: object, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor) -> None:
        """Split-KV stays on in every bucket, although past 2 CTAs x SMs / kv heads rows FlashInfer never
        splits and the graph's merge kernel only copies: without split-KV FlashInfer's decode kernel
        itself is slower."""
        kv = self.kv_cache
        wrapper.plan(indptr, indices, last, num_qo_heads=self.num_heads,  # type: ignore[attr-defined]
                     num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim, page_size=kv.page_size,
                     window_left=self._window_left, sm_scale=self.scale, q_data_type=kv.dtype, kv_data_type=kv.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False) -> torch.Tensor:
        # q: [T, Hq, D], k/v: [T, Hkv, D]
        if not kv_stored:
            self.kv_cache.write(layer_id, self._out_cache_loc, k, v)
        wrapper: Any = self._wrapper
        out: torch.Tensor
        if wrapper is self._ragged:  # the step's own keys are all there is
            out = wrapper.run(q.contiguous(), k.contiguous(), v.contiguous())
        else:
            out = wrapper.run(q.contiguous(), self.kv_cache.paged(layer_id))
        return out
