"""KV memory: one K and one V tensor per layer over a flat array of token slots."""

from __future__ import annotations

from typing import Callable

import torch

from .. import ops


class KVCache:
    """``k[layer]``/``v[layer]``: [num_slots, num_kv_heads, head_dim]; slot s is page s // page_size.

    Slot 0 (page 0) is reserved for padded tokens: anything may be written there.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        store: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] = ops.store_kv,
    ) -> None:
        self._store = store
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: [T], k/v: [T, Hkv, D]
        self._store(self.k[layer_id], self.v[layer_id], loc, k, v)

    def paged(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [num_pages, page_size, Hkv, D] of the same memory, for paged kernels."""
        shape = (self.num_slots // self.page_size, self.page_size, self.num_kv_heads, self.head_dim)
        return self.k[layer_id].view(shape), self.v[layer_id].view(shape)

    @property
    def bytes_per_token(self) -> int:
        return 2 * len(self.k) * self.num_kv_heads * self.head_dim * self.dtype.itemsize
