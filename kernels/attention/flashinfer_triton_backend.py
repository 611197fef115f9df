"""FlashInfer for EXTEND, MIXED and large batches, the project's Triton split-K kernel for DECODE and
TARGET_VERIFY steps (k drafts every request) of up to ``TRITON_DECODE_MAX_ROWS`` query rows (eager and
in CUDA graphs, chosen per graph bucket), over the one paged KV cache.

The Triton kernel decodes faster than FlashInfer's (tensor-core) decode kernel up to that batch size
(``modeserve bench attention``), and a verify step through it needs no plan on the host (its lengths
are read on the device); FlashInfer's prefill kernels, near the matmul rate, stay for extends."""

from __future__ import annotations

import torch

from .base import AttentionBackend, AttentionInputs, GraphInputs
from .flashinfer_backend import FlashInferAttentionBackend
from .kv_cache import KVCache

TRITON_DECODE_MAX_ROWS = 512  # above: FlashInfer (Triton's lead is not established for bigger batches)


class FlashInferTritonAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv_cache: KVCache, num_heads: int, scale: float, sliding_window: int | None,
                 flashinfer: AttentionBackend | None = None, triton: AttentionBackend | None = None) -> None:
        """``flashinfer``/``triton``: the two backends (built here when not given)."""
        super().__init__(kv_cache, num_heads, scale, sliding_window)
        if flashinfer is None:
            flashinfer = FlashInferAttentionBackend(kv_cache, num_heads, scale, sliding_window)
        if triton is None:
            # imports Triton, which may be absent on CPU where callers (tests) pass both halves
            from .triton_backend import TritonAttentionBackend

            triton = TritonAttentionBackend(kv_cache, num_heads, scale, sliding_window)
        self._flashinfer, self._triton = flashinfer, triton
        self._active: AttentionBackend = triton

    def _for_decode(self, rows: int) -> AttentionBackend:
        return self._triton if rows <= TRITON_DECODE_MAX_ROWS else self._flashinfer

    def init_forward_metadata(self, inputs: AttentionInputs) -> None:
        queries = inputs.uniform_queries
        rows = len(inputs.extend_lens_cpu) * queries
        self._active = self._for_decode(rows) if queries else self._flashinfer
        self._active.init_forward_metadata(inputs)

    def reads_lengths_on_device(self, inputs: AttentionInputs) -> bool:
        queries = inputs.uniform_queries
        return bool(queries) and self._for_decode(len(inputs.extend_lens_cpu) * queries).reads_lengths_on_device(inputs)

    def init_capture(self, bs: int, static: GraphInputs) -> None:
        self._active = self._for_decode(bs * static.tokens_per_row)
        self._active.init_capture(bs, static)

    def init_replay(self, inputs: AttentionInputs, bs: int) -> None:
        self._active = self._for_decode(bs * (inputs.extend_lens_cpu[0] if inputs.extend_lens_cpu else 1))
        self._active.init_replay(inputs, bs)

    def kv_destination(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._active.kv_destination(layer_id)

    def forward_decode_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                              cos_sin: torch.Tensor, layer_id: int) -> torch.Tensor | None:
        return self._active.forward_decode_rotary(q, k, v, positions, cos_sin, layer_id)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False) -> torch.Tensor:
        return self._active.forward(q, k, v, layer_id, kv_stored)
