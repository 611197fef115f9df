"""CUDA graphs for the decode-like modes: one captured forward per batch-size bucket, all sharing
one memory pool. A batch is padded to the next bucket (padded rows write KV slot 0, which is
reserved), replayed, and sliced back."""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from typing import Callable

import torch
from tqdm import tqdm

from modeserve.engine.forward_mode import ForwardMode
from modeserve.engine.models.llama import LlamaForCausalLM
from modeserve.kernels.attention.base import AttentionBackend, AttentionInputs

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class CudaGraphRunner:
    """Invariant: captured graphs read their inputs only from the static buffers below; ``prepare``
    copies the step's real rows there (padding the bucket) and plans attention, ``replay`` runs."""

    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend, max_bs: int, device: torch.device,
                 progress: Callable[[str], None] | None = None) -> None:
        self.model, self.attn = model, attn
        self.buckets = [b for b in DEFAULT_BUCKETS if b <= max_bs] or [max_bs]
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.hits: dict[str, int] = defaultdict(int)
        self.misses: dict[str, int] = defaultdict(int)
        self.padded_rows: dict[str, int] = defaultdict(int)
        self._capture_all(progress)

    @torch.inference_mode()
    def _capture_all(self, progress: Callable[[str], None] | None) -> None:
        pool = None
        bar = tqdm(list(reversed(self.buckets)), desc="Capturing CUDA graphs", unit="graph", leave=False)
        for bs in bar:  # largest first: later graphs reuse its memory
            bar.set_postfix(bs=bs)
            self.attn.init_capture(bs, self.out_cache_loc[:bs])
            for _ in range(2):  # warm up (lazy inits, autotuning) outside the graph
                self._forward(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
            if progress is not None:
                progress(f"cuda graph bs={bs}")
        logger.info("captured CUDA graphs for batch sizes %s", self.buckets)

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.attn)
        return self.model.compute_logits(hidden)  # [bs, V]

    def bucket_for(self, mode: ForwardMode, batch_size: int) -> int | None:
        """The bucket to replay, or None (eager): modes without graphs, or batches over the largest."""
        if not mode.traits.uses_cuda_graph:
            return None
        if batch_size > self.buckets[-1]:
            self.misses[mode.name] += 1
            return None
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    def prepare(self, inputs: AttentionInputs, input_ids: torch.Tensor, positions: torch.Tensor,
                bucket: int) -> None:
        """Copy the step's rows into the static buffers (padding the rest) and plan attention."""
        bs = input_ids.shape[0]
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        self.out_cache_loc[:bs].copy_(inputs.out_cache_loc)
        if bucket > bs:  # padded rows: token 0 at position 0, writing the reserved slot 0
            self.input_ids[bs:bucket].zero_()
            self.positions[bs:bucket].zero_()
            self.out_cache_loc[bs:bucket].zero_()
        self.attn.init_replay(inputs, bucket)
        self.hits[inputs.forward_mode.name] += 1
        self.padded_rows[inputs.forward_mode.name] += bucket - bs

    def replay(self, bucket: int, bs: int) -> torch.Tensor:
        """Replay the prepared bucket; logits [bs, V] of the real rows."""
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:bs]

    def stats(self) -> dict[str, dict[str, int]]:
        return {"hits": dict(self.hits), "misses": dict(self.misses), "padded_rows": dict(self.padded_rows)}
