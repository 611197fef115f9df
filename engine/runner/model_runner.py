"""The model runner: device memory and math for one ``ForwardBatch`` at a time.

``forward(batch)`` = apply admissions -> record tokens into the slot table -> attention metadata ->
model -> logits of the sampling rows -> sample. It keeps no scheduling state.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import numpy as np
import torch

from ..config import RunnerConfig, SchedulerConfig
from ..forward_batch import ForwardBatch, ForwardResult
from ..forward_mode import ForwardMode
from ..models.dllm_spec import DllmSpec
from ..models.linear import choose_gemv, use_small_gemm
from ..models.loader import Checkpoint, load_model, torch_dtype
from .chained_verify import ChainedVerify, chained_rows, host_prefix_lens
from .cuda_graph_runner import CudaGraphRunner
from .draft_model import DraftModel
from .host_io import PendingResult, upload
from .piecewise_graphs import PiecewiseExtend
from .slot_state import SlotState
from .input_fences import InputFences, on_side_lane
from .side_stream import SideStream
from .split_prefill import SplitPrefill
from .step_result import Launched, StepSampler, dllm_block_index
from ..distributed.group import TpGroup
from ..distributed.shard import head_rows, local_config
from ...kernels.attention.base import (AttentionInputs, create_attention_backend, one_block_a_request,
                                       resolve_backend_name)
from ...kernels.attention.kv_cache import KVCache
from ...kernels.op_set import SMALL_GEMM_MAX_ROWS, kernel_ops

logger = logging.getLogger(__name__)


def kv_cache_slots(cfg: RunnerConfig, bytes_per_token: int, max_context: int) -> int:
    """Token slots of the KV pool, a whole number of pages, including the reserved page 0."""
    if cfg.kv_cache_tokens is not None:
        tokens = cfg.kv_cache_tokens
    else:
        tokens = int(cfg.kv_cache_memory_gb * 2**30) // bytes_per_token
        tokens = min(tokens, cfg.max_running_requests * max_context)
    pages = max(tokens // cfg.page_size, 1)
    return (pages + 1) * cfg.page_size


# the modes whose eager steps may replay piecewise graphs (attention eager between the pieces): the
# prefills, and a block-diffusion step its DLLM_EXTEND graphs do not take (prompt blocks, a committed block)
_PIECEWISE_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DLLM_EXTEND)
VERIFY_GRAPH_MAX_BS = 64  # TARGET_VERIFY (and draft DECODE) graphs: speculation pays at small batches


class ModelRunner:
    def __init__(self, cfg: RunnerConfig, ckpt: Checkpoint, progress: Callable[[str], None] | None = None,
                 draft: Checkpoint | None = None, verify_queries: int = 0,
                 ngram: tuple[int, int] | None = None, dllm: DllmSpec | None = None,
                 tp: TpGroup | None = None) -> None:
        """``draft``: the draft model of speculative decoding (``speculative_algorithm="draft"``).
        ``verify_queries``: k + 1 with speculative decoding (TARGET_VERIFY steps of k drafts a request
        replay graphs; other verify steps run eagerly), 0 without. ``ngram``: (min, max) suffix of the
        n-gram drafts of chained verify rows, made on the device (``chained_verify``); default: those
        of ``SchedulerConfig`` (a router's scheduler may speculate over an engine started without). ``dllm``:
        a block-diffusion model's block (``models.dllm_spec.resolve_dllm``): it runs DLLM_EXTEND steps only.
        ``tp``: this process's rank of a tensor-parallel engine (its share of the heads and MLP); rank 0's
        ``launch`` and ``compute_logits`` send each batch to the other ranks, which run it alike
        (``distributed.worker``), and its sampled tokens to them."""
        self.cfg = cfg
        self.tp = tp
        self.dllm = dllm
        self.verify_queries = verify_queries
        self.model_config = local_config(ckpt.config, tp.size) if tp is not None else ckpt.config
        self.device = torch.device(cfg.device)
        self.dtype = torch_dtype(cfg.torch_dtype_name)
        self.max_context = min(cfg.max_context_len or ckpt.config.max_position_embeddings,
                               ckpt.config.max_position_embeddings)
        self._fences = InputFences(self.device, cfg.enable_split_prefill_overlap)
        self._step = Launched()  # what the step being launched leaves for its sampling
        self._init_model(ckpt, progress)
        self._init_memory()
        self.split = SplitPrefill(ckpt.config.num_layers)
        self.sampler = StepSampler(self.slots, self.kernel_ops, self.device,
                                   tp.broadcast if tp is not None else None, dllm)
        # a split prefill's slices beside the decode steps, on a stream of their own
        self.side_stream = (SideStream(self.device, cfg.split_prefill_overlap_sms, cfg.split_prefill_confine_decodes)
                            if cfg.enable_split_prefill_overlap else None)
        self.chained = ChainedVerify(self.slots, *(ngram or (SchedulerConfig.speculative_ngram_min,
                                                             SchedulerConfig.speculative_ngram_max)),
                                     self.kernel_ops.chain_verify_rows)
        self._init_attention()
        if dllm is not None and self.attention_backend_name not in ("torch", "triton"):
            raise ValueError(f"block-diffusion attention (DLLM_EXTEND) runs on the torch and triton attention "
                             f"backends, not {self.attention_backend_name}: pass attention_backend='triton' or 'torch'")
        self._init_cuda_graphs(progress)
        self.draft = (DraftModel(draft, cfg, self.dtype, self.device, self.num_kv_slots, self.max_context,
                                 self.kernel_ops, self.slots.req_to_token, self._verify_graph_max_bs)
                      if draft is not None else None)

    def _init_model(self, ckpt: Checkpoint, progress: Callable[[str], None] | None) -> None:
        self.kernel_ops = kernel_ops(self.cfg.kernel_backend, self.device)
        tp = (self.tp.rank, self.tp.size) if self.tp is not None else (0, 1)
        self.model = load_model(ckpt, self.dtype, self.device, self.max_context, progress, self.kernel_ops, tp)
        if self.tp is not None:
            for layer in self.model.decoder_layers():  # row parallel: the ranks' partial sums added up
                layer.self_attn.o_proj.combine = layer.mlp.down_proj.combine = self.tp.all_reduce
            if head_rows(ckpt.config, self.tp.rank, self.tp.size) is not None:  # vocabulary parallel
                self.model.lm_head.combine = self.tp.all_gather
        self.gemv_report: dict[str, dict[str, float | bool]] = {}
        gemv = self.kernel_ops.gemv
        if gemv is not None and self.kernel_ops.gemv_timer is not None and self.device.type == "cuda":
            self.gemv_report = choose_gemv(self.model, gemv, self.kernel_ops.gemv_timer,
                                           self.kernel_ops.gemv_add_rms_norm)
        if self.cfg.small_batch_gemm == "triton":
            self._use_small_gemm()

    def _use_small_gemm(self) -> None:
        ops = self.kernel_ops
        if self.device.type != "cuda" or ops.small_gemm is None or ops.small_gemm_prepare is None:
            raise ValueError("small_batch_gemm='triton' needs a CUDA device and the Triton kernels "
                             f"(kernel_backend {self.cfg.kernel_backend!r} on {self.device})")
        rows = min(SMALL_GEMM_MAX_ROWS, self.cfg.max_running_requests)
        use_small_gemm(self.model, ops.small_gemm, rows, ops.small_gemm_prepare)
        logger.info("linear layers of up to %d rows: Triton's small GEMM", rows)

    def _init_memory(self) -> None:
        mc = self.model_config
        bytes_per_token = mc.kv_bytes_per_token * self.dtype.itemsize
        self.num_kv_slots = kv_cache_slots(self.cfg, bytes_per_token, self.max_context)
        self.kv_cache = KVCache(
            mc.num_layers, self.num_kv_slots, mc.num_kv_heads, mc.head_dim, self.cfg.page_size, self.dtype, self.device,
            self.kernel_ops.store_kv,
        )
        self.slots = SlotState(self.cfg.max_running_requests, self.max_context, self.device, self.cfg.page_size,
                               self.kernel_ops.record_tokens)
        logger.info(
            "KV cache: %d slots (%d pages of %d), %.1f MiB",
            self.num_kv_slots, self.num_kv_slots // self.cfg.page_size, self.cfg.page_size,
            self.num_kv_slots * bytes_per_token / 2**20,
        )

    def _init_attention(self) -> None:
        mc = self.model_config
        self.attention_backend_name = resolve_backend_name(self.cfg.attention_backend, self.device, self.dtype,
                                                           mc.head_dim)
        self.attn = create_attention_backend(
            self.attention_backend_name,
            self.device,
            self.dtype,
            kv_cache=self.kv_cache,
            num_heads=mc.num_heads,
            scale=1.0 / math.sqrt(mc.head_dim),
            sliding_window=mc.sliding_window,
        )

    @property
    def _many_queries_graph_max_bs(self) -> int:
        """The largest bucket of graphs of several queries a request (TARGET_VERIFY's k + 1, a DLLM block)."""
        return min(self.cfg.cuda_graph_max_bs, self.cfg.max_running_requests, VERIFY_GRAPH_MAX_BS)

    @property
    def _verify_graph_max_bs(self) -> int:
        """The largest TARGET_VERIFY (and draft DECODE) graph bucket; 0: none."""
        if self.device.type != "cuda" or self.cfg.disable_cuda_graph or not self.verify_queries:
            return 0
        return self._many_queries_graph_max_bs

    def _init_cuda_graphs(self, progress: Callable[[str], None] | None) -> None:
        self.graphs: CudaGraphRunner | None = None
        self.verify_graphs: CudaGraphRunner | None = None
        self.dllm_graphs: CudaGraphRunner | None = None
        self.piecewise: PiecewiseExtend | None = None
        if self.device.type != "cuda" or self.cfg.disable_cuda_graph:
            return
        if self.cfg.enable_piecewise_cuda_graph:
            self.piecewise = PiecewiseExtend(self.model, self.attn, self.cfg.piecewise_cuda_graph_max_tokens,
                                             self.device, self.dtype, progress=progress)
        if not self.attn.supports_cuda_graph:
            logger.info("attention backend %s has no CUDA-graph support: decode runs eagerly",
                        self.attention_backend_name)
            return
        if self.dllm is not None:  # no decode steps: DLLM_EXTEND steps of one block a request replay graphs
            self.dllm_graphs = CudaGraphRunner(self.model, self.attn, self._many_queries_graph_max_bs, self.device,
                                               self.slots.req_to_token, progress, ForwardMode.DLLM_EXTEND,
                                               self.dllm.block_size)
            return
        max_bs = min(self.cfg.cuda_graph_max_bs, self.cfg.max_running_requests)
        confined = self.side_stream.group if self.side_stream is not None else None
        self.graphs = CudaGraphRunner(self.model, self.attn, max_bs, self.device, self.slots.req_to_token, progress,
                                      confined=confined)
        self.capture_verify_graphs(self.verify_queries, progress)

    def capture_verify_graphs(self, queries: int, progress: Callable[[str], None] | None = None) -> None:
        """TARGET_VERIFY graphs for ``queries`` (k + 1) tokens a request, in place of any before (verify
        steps of other lengths run eagerly); none without decode graphs or speculative decoding."""
        self.verify_queries = queries
        self.verify_graphs = None
        if self.graphs is not None and self._verify_graph_max_bs:
            self.verify_graphs = CudaGraphRunner(self.model, self.attn, self._verify_graph_max_bs, self.device,
                                                 self.slots.req_to_token, progress, ForwardMode.TARGET_VERIFY, queries)

    @property
    def num_pages(self) -> int:
        return self.num_kv_slots // self.cfg.page_size

    @torch.inference_mode()
    def compute_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model on ``batch``; logits [S, V] (the model's dtype) of the rows that sample."""
        self._send("compute_logits", batch)
        if self.side_stream is None:
            return self._logits(batch)
        with self.side_stream.lane(batch):
            logits = self._logits(batch)
        return self.side_stream.hand_over(logits) if on_side_lane(batch) else logits

    def _send(self, method: str, batch: ForwardBatch) -> None:
        """Rank 0 of a tensor-parallel engine: the other ranks run ``method`` on ``batch`` too."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.send_step((method, batch))

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        batch.forward_mode.require_supported()
        self._check_model_kind(batch.forward_mode)
        self.split.release(batch.released_slots)
        if batch.forward_mode == ForwardMode.SPLIT_PREFILL:
            self.split.check(batch)  # before anything is recorded
        self._fences.wait(batch)
        for adm in batch.admissions:
            self.slots.admit(adm)
        for upd in batch.slot_updates:
            self.slots.update(upd)
        self._step = Launched()
        if batch.forward_mode == ForwardMode.IDLE or batch.num_tokens == 0:
            if batch.padded_batch_size > 0 and self.graphs is not None:
                self._replay_padding_only(batch)  # lockstep: the other ranks replay this bucket too
            return torch.zeros(0, self.model_config.vocab_size, device=self.device)
        rows_np = np.repeat(batch.req_pool_indices, batch.extend_lens)  # [T]
        self.slots.record_pages(rows_np, batch.positions, batch.out_cache_loc)
        chained = chained_rows(batch)
        self._step.chained = chained is not None
        graphs, bucket = self._graphs_for(batch), None
        if graphs is not None and batch.padded_batch_size >= 0:  # -1: lockstep says eager
            bucket = graphs.bucket_for(batch.forward_mode, max(batch.batch_size, batch.padded_batch_size))
        if graphs is not None and bucket is not None:
            return self._replay(batch, graphs, bucket, chained)
        sample_idx_np = dllm_block_index(batch, self.dllm.block_size) if self.dllm is not None else batch.sample_token_index()  # [S]
        input_ids, positions, out_cache_loc, req_pool, seq_lens, rows, sample_idx = upload(
            [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens,
             rows_np, sample_idx_np], self.device)
        inputs = self._record(batch, chained, rows, positions, out_cache_loc, input_ids, req_pool, seq_lens)
        input_ids = self._drafted(batch, input_ids, out_cache_loc, req_pool, rows, positions)
        self.attn.init_forward_metadata(inputs)
        self._fences.mark(batch)
        self._step.input_ids, self._step.positions = input_ids, positions  # a verify step's acceptance reads them
        pieces = self.piecewise if batch.forward_mode in _PIECEWISE_MODES else None
        bucket = pieces.bucket_for(batch.num_tokens) if pieces is not None else None
        hidden: torch.Tensor | None
        if batch.forward_mode == ForwardMode.SPLIT_PREFILL:  # None before the last slice
            hidden = self.split.run(self.model, batch, input_ids, positions, self.attn)
        elif pieces is not None and bucket is not None:  # the model in captured pieces, attention eager
            hidden = pieces.run(bucket, input_ids, positions, out_cache_loc)
        else:
            hidden = self.model(input_ids, positions, self.attn)  # [T, hidden]
        if self.draft is not None and batch.forward_mode.traits.is_extend and (
                batch.split_layers is None or batch.split_layers.begin == 0):
            self.draft.extend(input_ids, positions, inputs)  # DRAFT_EXTEND: the draft's keys of these tokens
        if hidden is None:
            return torch.zeros(0, self.model_config.vocab_size, device=self.device)
        return self.model.compute_logits(hidden[sample_idx])

    def _check_model_kind(self, mode: ForwardMode) -> None:
        """A block-diffusion model takes DLLM_EXTEND (and IDLE) steps only; an autoregressive one, no DLLM_EXTEND."""
        if self.dllm is not None and mode not in (ForwardMode.DLLM_EXTEND, ForwardMode.IDLE):
            raise ValueError(f"forward mode {mode.name}: this engine serves a block-diffusion model, which runs "
                             f"DLLM_EXTEND steps only")
        if self.dllm is None and mode == ForwardMode.DLLM_EXTEND:
            raise ValueError("forward mode DLLM_EXTEND: this engine serves an autoregressive model")

    def _record(self, batch: ForwardBatch, chained: np.ndarray | None, rows: torch.Tensor, positions: torch.Tensor,
                out_cache_loc: torch.Tensor, input_ids: torch.Tensor, req_pool: torch.Tensor,
                seq_lens: torch.Tensor) -> AttentionInputs:
        """Record the step's tokens in the slot table (chained verify rows resolved first, and drafted
        after: ``chained_verify``); the step's attention inputs. An attention backend that plans on the
        host gets the chained rows' lengths from the device (the one wait for it here)."""
        if chained is None:
            self.slots.record(rows, positions, out_cache_loc, input_ids)
            return self._attention_inputs(batch, req_pool, seq_lens, out_cache_loc)
        starts = self.chained.resolve(batch, chained, positions, seq_lens, out_cache_loc, input_ids)
        self.slots.record(rows, positions, out_cache_loc, input_ids)
        inputs = self._attention_inputs(batch, req_pool, seq_lens, out_cache_loc)
        if self.attn.reads_lengths_on_device(inputs):
            return inputs
        return dataclasses.replace(inputs, prefix_lens_cpu=host_prefix_lens(batch, starts, positions))

    def _attention_inputs(self, batch: ForwardBatch, req_pool: torch.Tensor, seq_lens: torch.Tensor,
                          out_cache_loc: torch.Tensor) -> AttentionInputs:
        return AttentionInputs(
            forward_mode=batch.forward_mode,
            req_pool_indices=req_pool,
            prefix_lens_cpu=batch.prefix_lens.tolist(),
            extend_lens_cpu=batch.extend_lens.tolist(),
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            req_to_token=self.slots.req_to_token,
            dtype=self.dtype,
            req_pool_indices_cpu=batch.req_pool_indices,
            req_to_page_cpu=self.slots.req_to_page,
            block_size=self.dllm.block_size if self.dllm is not None else 0,
        )

    def _drafted(self, batch: ForwardBatch, input_ids: torch.Tensor, out_cache_loc: torch.Tensor,
                 req_pool: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A verify step's input ids with the draft model's drafts in (recorded in the slot table too);
        ``input_ids`` itself for other steps and without a draft model."""
        if self.draft is None or batch.forward_mode != ForwardMode.TARGET_VERIFY:
            return input_ids
        drafted = self.draft.propose(batch, input_ids, out_cache_loc, req_pool, self.slots)
        self.slots.token_ids[rows, positions] = drafted  # the drafts' ids (their slots are recorded)
        return drafted

    def _graphs_for(self, batch: ForwardBatch) -> CudaGraphRunner | None:
        """The graphs that may replay ``batch``: DECODE's (IDLE's too), TARGET_VERIFY's when every
        request carries k drafts, DLLM_EXTEND's when every request brings its current block alone."""
        if batch.forward_mode == ForwardMode.DLLM_EXTEND:  # each request's current block, sampled, alone
            graphs = self.dllm_graphs
            if graphs is None or not batch.sample_mask.all():
                return None
            steady = one_block_a_request(batch.extend_lens.tolist(), batch.prefix_lens.tolist(), graphs.q)
            return graphs if steady else None
        if batch.forward_mode != ForwardMode.TARGET_VERIFY:
            return self.graphs
        if self.verify_graphs is None or not (batch.extend_lens == self.verify_graphs.q).all():
            return None
        return self.verify_graphs

    def _replay(self, batch: ForwardBatch, graphs: CudaGraphRunner, bucket: int,
                chained: np.ndarray | None = None) -> torch.Tensor:
        """A graph step (``graphs.q`` queries a request, every query samples): the rows go straight into
        the graph's static buffer, the tokens are recorded there in place (a verify step's drafts
        written in by the draft model first, if any), then the bucket replays."""
        self._step.bucket = bucket
        rows = graphs.upload(batch.forward_mode, bucket, [
            batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens])
        token_rows = rows.req_pool_indices if graphs.q == 1 else rows.req_pool_indices.repeat_interleave(graphs.q)
        inputs = self._record(batch, chained, token_rows, rows.positions, rows.out_cache_loc, rows.input_ids,
                              rows.req_pool_indices, rows.seq_lens)
        drafted = self._drafted(batch, rows.input_ids, rows.out_cache_loc, rows.req_pool_indices, token_rows,
                                rows.positions)
        if drafted is not rows.input_ids:  # a decode step copies nothing
            rows.input_ids.copy_(drafted)
        self.attn.init_replay(inputs, bucket)
        self._fences.mark(batch)
        self._step.input_ids, self._step.positions = rows.input_ids, rows.positions
        if graphs.q == 1 and batch.sample_mask.all():
            self._step.sample_slots = rows.req_pool_indices
        return graphs.replay(bucket, batch.batch_size, self.side_stream is not None and self.side_stream.confining)

    def _replay_padding_only(self, batch: ForwardBatch) -> None:
        """An IDLE rank in lockstep replays the bucket the others use, with padding rows only."""
        assert self.graphs is not None
        bucket = self.graphs.bucket_for(ForwardMode.DECODE, batch.padded_batch_size)
        if bucket is not None:
            self._replay(batch, self.graphs, bucket)  # no rows: the upload writes padding only

    @torch.inference_mode()
    def launch(self, batch: ForwardBatch) -> PendingResult[ForwardResult]:
        """Queue ``batch`` on the device; the result arrives through ``PendingResult.result()``.

        Nothing here waits for the device, so the next batch can be prepared (and launched) while
        this one runs; its placeholders resolve from ``last_token``, written in stream order.
        """
        self._send("launch", batch)
        if self.side_stream is None:
            return self._launch(batch)
        with self.side_stream.lane(batch):
            return self._launch(batch)

    def _launch(self, batch: ForwardBatch) -> PendingResult[ForwardResult]:
        logits = self._logits(batch)  # [S, V]
        return self.sampler.result(batch, logits, self._step)

    def forward(self, batch: ForwardBatch) -> ForwardResult:
        return self.launch(batch).result()
