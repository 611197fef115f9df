"""CUDA graphs for the decode-like modes: one captured forward per batch-size bucket, all sharing
one memory pool. A batch is padded to the next bucket (padded rows write KV slot 0, which is
reserved), replayed, and sliced back.

One runner serves one mode with a fixed number ``q`` of query tokens a request: DECODE (q = 1, IDLE
replays its buckets too), TARGET_VERIFY (q = k + 1: a request's last token and its k drafts) or
DLLM_EXTEND (q = the block size: each request's current block, whose queries see each other).
A graph reads its step inputs from one static int64 buffer, laid out per bucket as consecutive runs:
token ids, positions and KV slots (``q * bs`` each), request rows and sequence lengths (``bs`` each); ``upload`` fills a bucket's runs, padding included, with one host-to-device
copy. A padded request is ``q`` tokens at position 0 writing the reserved slot 0 over request row 0.

With a ``confined`` stream (a CUDA green context's: ``split_prefill_confine_decodes``) each bucket is
captured a second time on it, over the same static buffer and attention plan, and those are the ones
replayed there: a graph keeps the context it was captured in, whichever stream replays it (measured on
an H100: docs/benchmarks.md, session 53), so one captured in the primary context would use every SM.
"""

from __future__ import annotations

import bisect
import contextlib
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

# per bucket, the static runs in order (the first three a token each, the rest a request each)
STATIC_RUNS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")
TOKEN_RUNS = 3
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
                 slot_table: torch.Tensor, progress: Callable[[str], None] | None = None,
                 mode: ForwardMode = ForwardMode.DECODE, tokens_per_row: int = 1,
                 confined: torch.cuda.Stream | None = None) -> None:
        """``slot_table``: the engine's req_to_token (allocated once): every replay reads it. ``mode``
        and ``tokens_per_row``: the steps this runner replays (DECODE and 1, or TARGET_VERIFY and k + 1).
        ``confined``: a green context's stream to capture each bucket on as well (the module says why)."""
        self.model, self.attn, self._slot_table = model, attn, slot_table
        self.mode, self.q = mode, tokens_per_row
        self.buckets = [b for b in DEFAULT_BUCKETS if b <= max_bs] or [max_bs]
        self._pad = (0, 0, 0, 0, self.q)  # per run: a padded request's value
        self._static = torch.zeros(self._run_offsets(self.buckets[-1])[-1], dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.confined: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # captured on ``confined``
        self.hits: dict[str, int] = defaultdict(int)
        self.misses: dict[str, int] = defaultdict(int)
        self.padded_rows: dict[str, int] = defaultdict(int)
        self._pool = torch.cuda.graph_pool_handle()  # the memory every graph of this runner shares
        self._capture_all(self.graphs, None, progress)
        if confined is not None:
            self._capture_all(self.confined, confined, progress)

    def _run_offsets(self, bs: int) -> list[int]:
        """Where each of bucket ``bs``'s runs starts in the static buffer, and where the last ends."""
        lengths = [self.q * bs] * TOKEN_RUNS + [bs] * (len(STATIC_RUNS) - TOKEN_RUNS)
        return [0, *np.cumsum(lengths).tolist()]

    def rows(self, bs: int, n: int | None = None) -> StepRows:
        """Bucket ``bs``'s static runs, each cut to its first ``n`` requests (all ``bs`` by default)."""
        n = bs if n is None else n
        at = self._run_offsets(bs)
        return StepRows(*(self._static[at[k] : at[k] + (self.q * n if k < TOKEN_RUNS else n)]
                          for k in range(len(STATIC_RUNS))))

    @torch.inference_mode()
    def _capture_all(self, into: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]],
                     stream: torch.cuda.Stream | None, progress: Callable[[str], None] | None) -> None:
        """Capture every bucket into ``into`` on ``stream`` (default: a side stream of torch's)."""
        where = "" if stream is None else " (confined)"
        bar = tqdm(list(reversed(self.buckets)), desc=f"Capturing CUDA graphs{where}", unit="graph", leave=False)
        for bs in bar:  # largest first: later graphs reuse its memory
            bar.set_postfix(bs=bs)
            rows = self.rows(bs)
            for run, pad in zip(rows, self._pad):
                run.fill_(pad)
            self.attn.init_capture(bs, GraphInputs(rows.out_cache_loc, rows.req_pool_indices, rows.seq_lens,
                                                   self._slot_table, self.q, self.mode == ForwardMode.DLLM_EXTEND))
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for _ in range(2):  # warm up (lazy inits, autotuning, the stream's cuBLAS workspace) outside the graph
                    self._forward(rows)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                out = self._forward(rows)
            into[bs] = (graph, out)
            if progress is not None:
                progress(f"cuda graph bs={bs}{where}")
        logger.info("captured %s CUDA graphs%s (%d tokens a request) for batch sizes %s", self.mode.name, where,
                    self.q, self.buckets)

    def _forward(self, rows: StepRows) -> torch.Tensor:
        hidden = self.model(rows.input_ids, rows.positions, self.attn)
        return self.model.compute_logits(hidden)  # [q * bs, V]

    def bucket_for(self, mode: ForwardMode, batch_size: int) -> int | None:
        """The bucket to replay, or None (eager): other modes (IDLE replays DECODE's), or batches over
        the largest."""
        if mode != self.mode and not (mode == ForwardMode.IDLE and self.mode == ForwardMode.DECODE):
            return None
        if batch_size > self.buckets[-1]:
            self.misses[mode.name] += 1
            return None
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    def upload(self, mode: ForwardMode, bucket: int, host: Sequence[np.ndarray]) -> StepRows:
        """Write a step's rows (``host``: its arrays in ``STATIC_RUNS`` order: [q * n] token ids,
        positions and KV slots, [n] request rows and sequence lengths) into ``bucket``'s runs, padded, with one asynchronous copy; views
        of the n real requests' rows."""
        n = len(host[3])
        lengths = [self.q * n] * TOKEN_RUNS + [n] * (len(STATIC_RUNS) - TOKEN_RUNS)
        if [len(a) for a in host] != lengths or n > bucket:
            raise ValueError(f"a {self.mode.name} graph step takes {self.q} queries a request, at most {bucket} "
                             f"requests (got runs of {[len(a) for a in host]})")
        at = self._run_offsets(bucket)
        packed = np.empty(at[-1], dtype=np.int64)
        for k, (a, pad) in enumerate(zip(host, self._pad)):
            used = at[k] + len(a)
            packed[at[k] : used] = a
            packed[used : at[k + 1]] = pad
        upload_into(packed, self._static[: packed.size])
        self.hits[mode.name] += 1
        self.padded_rows[mode.name] += bucket - n
        return self.rows(bucket, n)

    def replay(self, bucket: int, bs: int, confined: bool = False) -> torch.Tensor:
        """Replay the prepared bucket (its capture on the ``confined`` stream if asked and made); logits
        [q * bs, V] of the real requests' tokens."""
        graph, out = (self.confined if confined and self.confined else self.graphs)[bucket]
        graph.replay()
        return out[: self.q * bs]

    def stats(self) -> dict[str, dict[str, int]]:
        return {"hits": dict(self.hits), "misses": dict(self.misses), "padded_rows": dict(self.padded_rows)}
