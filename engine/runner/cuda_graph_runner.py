"""CUDA graphs for the decode-like modes: one captured forward per batch-size bucket, all sharing
one memory pool. A batch is padded to the next bucket (padded rows write KV slot 0, which is
reserved), replayed, and sliced back.

A graph reads its step inputs (token ids, positions, KV slots, request rows, sequence lengths) from
one static int64 buffer, laid out per bucket as five consecutive runs of ``bs``; ``upload`` fills a
bucket's runs, padding included, with one host-to-device copy.
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
from tqdm import tqdm

from ..forward_mode import ForwardMode
from ..models.llama import LlamaForCausalLM
from .host_io import upload_into
from ...kernels.attention.base import AttentionBackend, GraphInputs

logger = logging.getLogger(__name__)

# per bucket, the static runs in order, and the value a padded row holds in each
STATIC_RUNS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")
PAD_VALUES = (0, 0, 0, 0, 1)  # token 0 at position 0 writing the reserved slot 0; request row 0, one key
DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class StepRows(NamedTuple):
    """Views of one bucket's static runs (``bs`` rows each, or the first n real rows)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor


class CudaGraphRunner:
    """Invariant: captured graphs read their inputs only from the static buffer; ``upload`` writes a
    step's rows there (padding the bucket), ``replay`` runs after the attention backend's
    ``init_replay``."""

    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend, max_bs: int, device: torch.device,
                 slot_table: torch.Tensor, progress: Callable[[str], None] | None = None) -> None:
        """``slot_table``: the engine's req_to_token (allocated once): every replay reads it."""
        self.model, self.attn, self._slot_table = model, attn, slot_table
        self.buckets = [b for b in DEFAULT_BUCKETS if b <= max_bs] or [max_bs]
        self._static = torch.zeros(len(STATIC_RUNS) * self.buckets[-1], dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.hits: dict[str, int] = defaultdict(int)
        self.misses: dict[str, int] = defaultdict(int)
        self.padded_rows: dict[str, int] = defaultdict(int)
        self._capture_all(progress)

    def rows(self, bs: int, n: int | None = None) -> StepRows:
        """Bucket ``bs``'s static runs, each cut to its first ``n`` rows (all ``bs`` by default)."""
        n = bs if n is None else n
        return StepRows(*(self._static[k * bs : k * bs + n] for k in range(len(STATIC_RUNS))))

    @torch.inference_mode()
    def _capture_all(self, progress: Callable[[str], None] | None) -> None:
        pool = None
        bar = tqdm(list(reversed(self.buckets)), desc="Capturing CUDA graphs", unit="graph", leave=False)
        for bs in bar:  # largest first: later graphs reuse its memory
            bar.set_postfix(bs=bs)
            rows = self.rows(bs)
            for run, pad in zip(rows, PAD_VALUES):
                run.fill_(pad)
            self.attn.init_capture(bs, GraphInputs(rows.out_cache_loc, rows.req_pool_indices, rows.seq_lens,
                                                   self._slot_table))
            for _ in range(2):  # warm up (lazy inits, autotuning) outside the graph
                self._forward(rows)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(rows)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
            if progress is not None:
                progress(f"cuda graph bs={bs}")
        logger.info("captured CUDA graphs for batch sizes %s", self.buckets)

    def _forward(self, rows: StepRows) -> torch.Tensor:
        hidden = self.model(rows.input_ids, rows.positions, self.attn)
        return self.model.compute_logits(hidden)  # [bs, V]

    def bucket_for(self, mode: ForwardMode, batch_size: int) -> int | None:
        """The bucket to replay, or None (eager): modes without graphs, or batches over the largest."""
        if not mode.traits.uses_cuda_graph:
            return None
        if batch_size > self.buckets[-1]:
            self.misses[mode.name] += 1
            return None
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    def upload(self, mode: ForwardMode, bucket: int, host: Sequence[np.ndarray]) -> StepRows:
        """Write a step's rows (``host``: its [n] arrays in ``STATIC_RUNS`` order, one query a row)
        into ``bucket``'s runs, padded, with one asynchronous copy; views of the n real rows."""
        n = len(host[0])
        if any(len(a) != n for a in host) or n > bucket:
            raise ValueError(f"a graph step takes one query a row, at most {bucket} rows")
        packed = np.empty((len(STATIC_RUNS), bucket), dtype=np.int64)
        for run, a, pad in zip(packed, host, PAD_VALUES):
            run[:n] = a
            run[n:] = pad
        upload_into(packed, self._static[: packed.size])
        self.hits[mode.name] += 1
        self.padded_rows[mode.name] += bucket - n
        return self.rows(bucket, n)

    def replay(self, bucket: int, bs: int) -> torch.Tensor:
        """Replay the prepared bucket; logits [bs, V] of the real rows."""
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:bs]

    def stats(self) -> dict[str, dict[str, int]]:
        return {"hits": dict(self.hits), "misses": dict(self.misses), "padded_rows": dict(self.padded_rows)}
