"""The attention backend interface and its registry (backends are imported lazily by name)."""

from __future__ import annotations

import abc
import importlib.util
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ...engine.forward_mode import ForwardMode
from ..registry import Registry
from .kv_cache import KVCache

# A draft model's catch-up (DRAFT_EXTEND) in a verify step: each request's last two tokens
CATCH_UP_QUERIES = 2


def one_block_a_request(extend_lens: Sequence[int], prefix_lens: Sequence[int], block: int) -> bool:
    """A DLLM_EXTEND step in which each request brings its current block alone, from the block's start
    (the step a decode kernel with whole-row queries takes, and its CUDA graphs replay)."""
    return block > 0 and len(extend_lens) > 0 and all(e == block for e in extend_lens) and all(
        p % block == 0 for p in prefix_lens)


@dataclass(frozen=True)
class AttentionInputs:
    """Per-step inputs every backend needs; device tensors plus host copies for planning."""

    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor  # [B] int64 (device)
    prefix_lens_cpu: list[int]  # [B]
    extend_lens_cpu: list[int]  # [B]
    seq_lens: torch.Tensor  # [B] int64 (device)
    out_cache_loc: torch.Tensor  # [T] int64 (device)
    req_to_token: torch.Tensor  # [max_reqs, max_context] int64 (device): KV slot of each position
    dtype: torch.dtype  # activation dtype
    # host copies for planning without device syncs (None where the caller has none)
    req_pool_indices_cpu: np.ndarray | None = None  # [B] int64
    req_to_page_cpu: np.ndarray | None = None  # [max_reqs, max_pages] int32: page of each request's k-th page
    # > 0: block-causal (DLLM_EXTEND): a query sees every key of its own block of this size and of the blocks
    # before it (blocks at multiples of it from position 0); 0: causal
    block_size: int = 0

    @property
    def one_token_per_row(self) -> bool:
        """Every row extends by one token (a decode; the attention kernels read it as one)."""
        return all(e == 1 for e in self.extend_lens_cpu)

    @property
    def uniform_queries(self) -> int:
        """The query tokens every request brings, where a decode kernel can take the step: 1 for a
        decode, k + 1 for a TARGET_VERIFY step in which each request has k drafts, 2 for a draft's
        catch-up (as its CUDA graphs run it, so that eager and replay use one kernel), the block size for a
        DLLM_EXTEND step of one block a request (its queries see the whole block); 0 for other steps."""
        lens = self.extend_lens_cpu
        if self.one_token_per_row:
            return 1
        if not lens or any(e != lens[0] for e in lens):
            return 0
        if self.forward_mode == ForwardMode.TARGET_VERIFY:
            return lens[0]
        if self.forward_mode == ForwardMode.DLLM_EXTEND:
            block = self.block_size
            return block if one_block_a_request(lens, self.prefix_lens_cpu, block) else 0
        return CATCH_UP_QUERIES if self.forward_mode == ForwardMode.DRAFT_EXTEND and lens[0] == CATCH_UP_QUERIES else 0

    @property
    def seq_lens_cpu(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu)]


@dataclass(frozen=True)
class GraphInputs:
    """The static device buffers a captured graph reads (int64): ``bs`` requests of
    ``tokens_per_row`` queries each (1 for DECODE, k + 1 for TARGET_VERIFY). The model runner owns
    them and fills them before every replay, a padded request with request row 0, sequence length
    ``tokens_per_row`` and KV slot 0 (reserved); at capture they hold padding only."""

    out_cache_loc: torch.Tensor  # [tokens_per_row * bs]: where each query's k/v of this step go
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs]
    req_to_token: torch.Tensor  # [max_reqs, max_context]: the engine's slot table (allocated once)
    tokens_per_row: int = 1
    whole_row: bool = False  # a request's queries see each other (DLLM_EXTEND: one block a request)


class AttentionBackend(abc.ABC):
    """Computes attention for one layer over the paged KV cache.

    Invariant: ``init_forward_metadata`` is called once per step before any layer's ``forward``;
    ``forward`` first writes this step's k/v at ``out_cache_loc`` (unless the caller already did, at
    ``kv_destination``), then attends each query to its request's keys ``req_to_token[r, :seq_len]``
    (causal: a query at position p sees keys <= p).
    """

    def __init__(self, kv_cache: KVCache, num_heads: int, scale: float, sliding_window: int | None) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self._out_cache_loc = torch.zeros(0, dtype=torch.int64, device=kv_cache.k[0].device)

    def kv_destination(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache, out_cache_loc) of this step and layer: where a fused op may store the
        step's k/v itself before ``forward(..., kv_stored=True)``."""
        return self.kv_cache.k[layer_id], self.kv_cache.v[layer_id], self._out_cache_loc

    @abc.abstractmethod
    def init_forward_metadata(self, inputs: AttentionInputs) -> None: ...

    def reads_lengths_on_device(self, inputs: AttentionInputs) -> bool:
        """Whether this step's attention reads its sequence lengths from ``inputs.seq_lens`` (device) alone,
        never from the host lists: then a step may carry lengths the device knows first (chained
        verify rows). False unless a backend says so."""
        return False

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]. ``kv_stored``: k/v are in the cache already."""

    def forward_decode_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                              cos_sin: torch.Tensor, layer_id: int) -> torch.Tensor | None:
        """A decode step's rotary embedding, KV store and attention in one op, for backends that have
        one: q/k not rotated yet (neox rotate-half with ``cos_sin`` [max_pos, D] = [cos | sin] at
        ``positions``), k/v not in the cache. None: not this step (the caller rotates, stores and
        calls ``forward``)."""
        return None

    # CUDA graphs (decode-like modes). A backend that sets ``supports_cuda_graph`` implements both, for
    # one query a request (DECODE) and for ``static.tokens_per_row`` > 1 (TARGET_VERIFY, causal over the
    # request's cache): ``init_capture`` before capturing ``bs`` requests (the graph reads them from ``static``),
    # ``init_replay`` before each replay, once the runner has written the real rows into ``static``
    # (``inputs``' device tensors are views of it; the backend plans whatever else it needs).
    supports_cuda_graph = False

    def init_capture(self, bs: int, static: GraphInputs) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_replay(self, inputs: AttentionInputs, bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


# (kv_cache, num_heads, scale, sliding_window) -> backend. Each factory imports its backend when
# called: the backends import this module, and Triton or FlashInfer, which only the chosen one needs.
ATTENTION_BACKENDS: Registry[[KVCache, int, float, int | None], AttentionBackend] = Registry("attention backend")


@ATTENTION_BACKENDS.register("torch")
def _create_torch(kv_cache: KVCache, num_heads: int, scale: float, sliding_window: int | None) -> AttentionBackend:
    from .torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(kv_cache, num_heads, scale, sliding_window)


@ATTENTION_BACKENDS.register("flashinfer")
def _create_flashinfer(kv_cache: KVCache, num_heads: int, scale: float,
                       sliding_window: int | None) -> AttentionBackend:
    from .flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(kv_cache, num_heads, scale, sliding_window)


@ATTENTION_BACKENDS.register("flashinfer-triton")
def _create_flashinfer_triton(kv_cache: KVCache, num_heads: int, scale: float,
                              sliding_window: int | None) -> AttentionBackend:
    from .flashinfer_triton_backend import FlashInferTritonAttentionBackend

    return FlashInferTritonAttentionBackend(kv_cache, num_heads, scale, sliding_window)


@ATTENTION_BACKENDS.register("triton")
def _create_triton(kv_cache: KVCache, num_heads: int, scale: float, sliding_window: int | None) -> AttentionBackend:
    from .triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(kv_cache, num_heads, scale, sliding_window)


_HALF = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # what its Hopper prefill kernels are built for


def available_backends() -> list[str]:
    return ATTENTION_BACKENDS.names()


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                         head_dim: int = 128) -> str:
    """``auto``: on CUDA for fp16/bf16, flashinfer-triton (FlashInfer extends, Triton decodes) when both
    are installed, flashinfer when only it is; else triton on CUDA when installed; else torch (the
    reference). Triton off CUDA only in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    flashinfer_ok = device.type == "cuda" and dtype in _HALF and head_dim in FLASHINFER_HEAD_DIMS
    if name != "auto":
        ATTENTION_BACKENDS.check(name)
        if name.startswith("flashinfer") and not flashinfer_ok:
            raise ValueError(f"attention backend {name} needs a CUDA device, dtype float16 or bfloat16 and "
                             f"head_dim in {FLASHINFER_HEAD_DIMS} (got {device.type}, {dtype}, {head_dim})")
        if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention backend triton needs a CUDA device, or TRITON_INTERPRET=1 for Triton's "
                             f"CPU interpreter (got {device.type})")
        return name
    if flashinfer_ok and _importable("flashinfer"):
        return "flashinfer-triton" if _importable("triton") else "flashinfer"
    if device.type == "cuda" and _importable("triton"):
        return "triton"
    return "torch"


def create_attention_backend(name: str, device: torch.device, dtype: torch.dtype, kv_cache: KVCache,
                             num_heads: int, scale: float, sliding_window: int | None) -> AttentionBackend:
    resolved = resolve_backend_name(name, device, dtype, kv_cache.head_dim)
    return ATTENTION_BACKENDS.create(resolved, kv_cache, num_heads, scale, sliding_window)
