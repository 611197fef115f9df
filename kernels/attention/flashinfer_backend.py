"""FlashInfer attention over the paged KV cache (CUDA, fp16/bf16).

DECODE uses ``BatchDecodeWithPagedKVCacheWrapper``; EXTEND and MIXED use one
``BatchPrefillWithPagedKVCacheWrapper`` over all rows (its causal mask is aligned to the end of
each request's KV, so decode rows of a MIXED batch are just rows with one query). ``plan`` runs
once per step on host metadata, outside any CUDA graph.
"""

from __future__ import annotations

import torch

from modeserve.kernels.attention.base import AttentionBackend, AttentionInputs
from modeserve.kernels.attention.kv_cache import KVCache

WORKSPACE_BYTES = 256 * 2**20


def page_table(inputs: AttentionInputs, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR page table of the batch: (indptr [B+1] int32, indices [P] int32, last_page_len [B] int32).

    A request's positions [k*ps, (k+1)*ps) share one page, so page k is
    ``req_to_token[r, k*ps] // ps`` (prefix-cache pages are whole pages too).
    """
    seq = torch.tensor(inputs.seq_lens_cpu, dtype=torch.int64)
    num_pages = (seq + page_size - 1) // page_size  # [B]
    max_pages = int(num_pages.max()) if len(seq) else 0
    starts = inputs.req_to_token[:, : max_pages * page_size : page_size][inputs.req_pool_indices]  # [B, Pmax]
    valid = torch.arange(max_pages)[None, :] < num_pages[:, None]
    indices = (starts[valid.to(starts.device)] // page_size).to(torch.int32)
    indptr = torch.zeros(len(seq) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(num_pages, 0)
    last = (seq - (num_pages - 1) * page_size).to(torch.int32)
    return indptr, indices, last


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, kv_cache: KVCache, num_heads: int, scale: float, sliding_window: int | None) -> None:
        super().__init__(kv_cache, num_heads, scale, sliding_window)
        import flashinfer

        device = kv_cache.k[0].device
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=True)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._window_left = sliding_window - 1 if sliding_window else -1
        self._wrapper: object = None
        self._graph_wrappers: dict[int, object] = {}  # batch-size bucket -> decode wrapper (fixed buffers)

    def init_forward_metadata(self, inputs: AttentionInputs) -> None:
        kv = self.kv_cache
        self._out_cache_loc = inputs.out_cache_loc
        indptr, indices, last = page_table(inputs, kv.page_size)
        dev = kv.k[0].device
        common = dict(num_qo_heads=self.num_heads, num_kv_heads=kv.num_kv_heads, page_size=kv.page_size,
                      window_left=self._window_left, sm_scale=self.scale, q_data_type=inputs.dtype,
                      kv_data_type=kv.dtype)
        if all(e == 1 for e in inputs.extend_lens_cpu):
            self._decode.plan(indptr.to(dev), indices, last.to(dev), head_dim=kv.head_dim, **common)
            self._wrapper = self._decode
        else:
            qo_indptr = torch.zeros(len(inputs.extend_lens_cpu) + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(torch.tensor(inputs.extend_lens_cpu, dtype=torch.int64), 0)
            self._prefill.plan(qo_indptr.to(dev), indptr.to(dev), indices, last.to(dev), head_dim_qk=kv.head_dim,
                               causal=True, **common)
            self._wrapper = self._prefill

    # ---- CUDA graphs (decode) -----------------------------------------------------------------
    supports_cuda_graph = True

    def init_capture(self, bs: int, out_cache_loc: torch.Tensor) -> None:
        """Make the decode wrapper for ``bs`` rows (fixed buffers) and plan a dummy batch: every
        row one token on the reserved page 0."""
        import flashinfer

        kv, dev = self.kv_cache, self.kv_cache.k[0].device
        max_pages = kv.num_slots // kv.page_size
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=dev))
        self._graph_wrappers[bs] = wrapper
        indptr = torch.arange(bs + 1, dtype=torch.int32)
        self._plan_decode(wrapper, indptr, torch.zeros(bs, dtype=torch.int32, device=dev),
                          torch.ones(bs, dtype=torch.int32))
        self._wrapper, self._out_cache_loc = wrapper, out_cache_loc

    def init_replay(self, inputs: AttentionInputs, bs: int) -> None:
        """Plan the real rows, padded to ``bs`` with one-token rows on page 0."""
        indptr, indices, last = page_table(inputs, self.kv_cache.page_size)
        pad = bs - (len(indptr) - 1)
        if pad:
            indptr = torch.cat([indptr, indptr[-1] + torch.arange(1, pad + 1, dtype=torch.int32)])
            indices = torch.cat([indices, torch.zeros(pad, dtype=torch.int32, device=indices.device)])
            last = torch.cat([last, torch.ones(pad, dtype=torch.int32)])
        self._plan_decode(self._graph_wrappers[bs], indptr, indices, last)
        self._wrapper = self._graph_wrappers[bs]

    def _plan_decode(self, wrapper: object, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor) -> None:
        kv = self.kv_cache
        wrapper.plan(indptr, indices, last, num_qo_heads=self.num_heads,  # type: ignore[attr-defined]
                     num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim, page_size=kv.page_size,
                     window_left=self._window_left, sm_scale=self.scale, q_data_type=kv.dtype, kv_data_type=kv.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        # q: [T, Hq, D], k/v: [T, Hkv, D]
        self.kv_cache.write(layer_id, self._out_cache_loc, k, v)
        out: torch.Tensor = self._wrapper.run(q.contiguous(), self.kv_cache.paged(layer_id))  # type: ignore[attr-defined]
        return out
