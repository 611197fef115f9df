"""Piecewise CUDA graphs for EXTEND and MIXED steps (and the DLLM_EXTEND steps that its own graphs do not
take): the model captured in pieces between its attention calls, one set of pieces per token-count
bucket, all sharing one memory pool.

An eager prefill of a few hundred tokens launches every op from Python, and on a fast GPU the
launches take longer than the kernels. Attention cannot be captured once for all EXTEND batches
(its plan and grid follow the batch's requests), but everything else in the model works row by row,
so it can: piece 0 is the embedding and layer 0 up to its KV store, piece i (0 < i < L) the end of
layer i-1 (output projection, MLP, norms) and the start of layer i (QKV projection, rotary, KV
store), piece L the end of the last layer. A step pads its tokens to the next bucket, replays the
pieces and runs each layer's attention eagerly in between on the real tokens only.

Padded tokens are token 0 at position 0 storing their k/v at the reserved slot 0; their rows go
through the GEMMs and norms and are dropped: nothing mixes rows except attention, which never sees
them. Static buffers carry a step's inputs, each layer's q/k/v for its attention and the
attention's output, the residual stream and the final hidden state between pieces.
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from typing import Callable, NamedTuple

import torch
from tqdm import tqdm

from ..models.llama import LlamaForCausalLM
from ...kernels.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def token_buckets(max_tokens: int) -> list[int]:
    """The buckets up to ``max_tokens`` (which is one itself, so every count up to it has a bucket)."""
    if max_tokens < 1:
        raise ValueError(f"piecewise CUDA graphs need max_tokens >= 1, got {max_tokens}")
    return sorted({b for b in DEFAULT_TOKEN_BUCKETS if b < max_tokens} | {max_tokens})


class StaticBuffers(NamedTuple):
    """One bucket's buffers (its first ``tokens`` rows of the largest bucket's)."""

    input_ids: torch.Tensor  # [Tb] int64
    positions: torch.Tensor  # [Tb] int64
    out_cache_loc: torch.Tensor  # [Tb] int64
    q: torch.Tensor  # [Tb, Hq, D]
    k: torch.Tensor  # [Tb, Hkv, D]
    v: torch.Tensor  # [Tb, Hkv, D]
    attn_out: torch.Tensor  # [Tb, Hq * D]
    hidden: torch.Tensor  # [Tb, hidden]: the next piece's normalised input, last: the final hidden state
    residual: torch.Tensor  # [Tb, hidden]


class PiecewiseExtend:
    """Invariant: a piece reads only the static buffers and writes its results back into them;
    ``run`` fills the step's inputs (padding the bucket) before the first piece, and each layer's
    attention reads q/k/v from the buffers and writes ``attn_out`` before the piece after it.

    ``capture=False`` runs the pieces directly instead of replaying graphs (CPU, and the tests of
    the split itself)."""

    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend, max_tokens: int, device: torch.device,
                 dtype: torch.dtype, capture: bool = True, progress: Callable[[str], None] | None = None) -> None:
        self.model, self.attn, self.capture = model, attn, capture
        self._layers, self._next_norms = model.decoder_layers(), model.next_norms()
        self.buckets = token_buckets(max_tokens)
        cfg = model.config
        top = self.buckets[-1]
        q_size = cfg.num_heads * cfg.head_dim
        self._ints = torch.zeros(3, top, dtype=torch.int64, device=device)
        self._q = torch.zeros(top, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self._k = torch.zeros(top, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
        self._v = torch.zeros_like(self._k)
        self._attn_out = torch.zeros(top, q_size, dtype=dtype, device=device)
        self._hidden = torch.zeros(top, cfg.hidden_size, dtype=dtype, device=device)
        self._residual = torch.zeros_like(self._hidden)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hits: dict[int, int] = defaultdict(int)
        self.padded_tokens = 0
        if capture:
            self._capture_all(progress)

    def buffers(self, tokens: int) -> StaticBuffers:
        ids, pos, loc = self._ints[:, :tokens]
        return StaticBuffers(ids, pos, loc, self._q[:tokens], self._k[:tokens], self._v[:tokens],
                             self._attn_out[:tokens], self._hidden[:tokens], self._residual[:tokens])

    def bucket_for(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def num_pieces(self) -> int:
        return self.model.config.num_layers + 1

    # ---- the pieces ---------------------------------------------------------------------------
    def _piece(self, bufs: StaticBuffers, i: int) -> None:
        """Piece ``i``: the end of layer i-1 (if any), then the start of layer i up to its KV store
        (if any), from and into ``bufs``."""
        layers = self._layers
        if i == 0:
            x, residual = self.model.embed(bufs.input_ids)
        else:
            x, residual = layers[i - 1].after_attention(bufs.attn_out, bufs.residual, self._next_norms[i - 1])
        if residual.data_ptr() != bufs.residual.data_ptr():
            bufs.residual.copy_(residual)
        if i == len(layers):
            bufs.hidden.copy_(x)
            return
        attn = layers[i].self_attn
        q, k, v = attn.project(x)
        kv = self.attn.kv_cache
        q, k = attn.rotate_and_store(q, k, v, bufs.positions, self.model.cos_sin,
                                     (kv.k[i], kv.v[i], bufs.out_cache_loc))
        bufs.q.copy_(q)
        bufs.k.copy_(k)
        bufs.v.copy_(v)

    def _attention(self, bufs: StaticBuffers, i: int, tokens: int) -> None:
        """Layer ``i``'s attention on the first ``tokens`` rows (eager: planned for this step)."""
        out = self.attn.forward(bufs.q[:tokens], bufs.k[:tokens], bufs.v[:tokens], i, kv_stored=True)
        bufs.attn_out[:tokens].copy_(out.reshape(tokens, -1))

    # ---- capture and replay -------------------------------------------------------------------
    @torch.inference_mode()
    def _capture_all(self, progress: Callable[[str], None] | None) -> None:
        pool = None
        bar = tqdm(list(reversed(self.buckets)), desc="Capturing piecewise CUDA graphs", unit="bucket", leave=False)
        for tokens in bar:  # largest first: later graphs reuse its memory
            bar.set_postfix(tokens=tokens)
            bufs = self.buffers(tokens)
            for run in (bufs.input_ids, bufs.positions, bufs.out_cache_loc):
                run.zero_()  # token 0 at position 0, stored at the reserved slot 0
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for i in range(self.num_pieces()):  # warm-up outside the graphs (lazy inits, autotuning)
                    self._piece(bufs, i)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graphs = []
            for i in range(self.num_pieces()):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(bufs, i)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[tokens] = graphs
            if progress is not None:
                progress(f"piecewise CUDA graphs: {tokens} tokens")
        torch.cuda.synchronize()
        logger.info("captured piecewise CUDA graphs for %d token buckets up to %d", len(self.buckets),
                    self.buckets[-1])

    def run(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor,
            out_cache_loc: torch.Tensor) -> torch.Tensor:
        """The final hidden states [T, hidden] of a step's T tokens, padded to ``bucket``; the
        attention backend is planned for the step already."""
        tokens = input_ids.shape[0]
        bufs = self.buffers(bucket)
        for run, real in ((bufs.input_ids, input_ids), (bufs.positions, positions), (bufs.out_cache_loc, out_cache_loc)):
            run[:tokens].copy_(real, non_blocking=True)
            run[tokens:].zero_()
        graphs = self.graphs.get(bucket)
        for i in range(self.num_pieces()):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(bufs, i)
            if i < self.num_pieces() - 1:
                self._attention(bufs, i, tokens)
        self.hits[bucket] += 1
        self.padded_tokens += bucket - tokens
        return bufs.hidden[:tokens]

    def stats(self) -> dict[str, object]:
        return {"hits": {str(b): n for b, n in sorted(self.hits.items())}, "padded_tokens": self.padded_tokens}
