"""FlashInfer for EXTEND and MIXED, the project's Triton split-K kernel for DECODE (eager and in
CUDA graphs), over the one paged KV cache.

``modeserve bench attention`` on an H200 (bf16, page 16, 544-token contexts, KV store included):
per layer the Triton decode step took 10.4/17.5/48.2/163.6 µs at batch 1/8/64/256 (head_dim 128,
8 kv heads) against FlashInfer's best of its two decode kernels at 13.8/20.0/58.7/168.9 µs; with
head_dim 64, 9.6/37.7 µs at batch 1/64 against 10.9/42.8. FlashInfer's prefill kernels stay for
extends (the 4096-token prefill ran at 0.815 of the measured matmul rate)."""

from __future__ import annotations

import torch

from modeserve.kernels.attention.base import AttentionBackend, AttentionInputs
from modeserve.kernels.attention.flashinfer_backend import FlashInferAttentionBackend
from modeserve.kernels.attention.kv_cache import KVCache
from modeserve.kernels.attention.triton_backend import TritonAttentionBackend


class FlashInferTritonAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv_cache: KVCache, num_heads: int, scale: float, sliding_window: int | None) -> None:
        super().__init__(kv_cache, num_heads, scale, sliding_window)
        self._extend = FlashInferAttentionBackend(kv_cache, num_heads, scale, sliding_window)
        self._decode = TritonAttentionBackend(kv_cache, num_heads, scale, sliding_window)
        self._active: AttentionBackend = self._decode

    def init_forward_metadata(self, inputs: AttentionInputs) -> None:
        self._active = self._decode if all(e == 1 for e in inputs.extend_lens_cpu) else self._extend
        self._active.init_forward_metadata(inputs)

    def init_capture(self, bs: int, out_cache_loc: torch.Tensor) -> None:
        self._active = self._decode
        self._decode.init_capture(bs, out_cache_loc)

    def init_replay(self, inputs: AttentionInputs, bs: int) -> None:
        self._active = self._decode
        self._decode.init_replay(inputs, bs)

    def kv_destination(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._active.kv_destination(layer_id)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False) -> torch.Tensor:
        return self._active.forward(q, k, v, layer_id, kv_stored)
