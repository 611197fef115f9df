"""A launched step's sampling and its pending result: the tokens drawn from the step's logits, their
log-probabilities when asked, a verify step's accepted drafts, a block-diffusion step's confidences.

Everything is queued on the current stream; the result is read when the caller asks
(``PendingResult.result``)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from ..forward_batch import ForwardBatch, ForwardResult
from ..forward_mode import ForwardMode
from ..models.dllm_spec import DllmSpec
from . import sampler
from .host_io import PendingResult, upload
from .slot_state import SlotState
from ...kernels.op_set import KernelOps


@dataclasses.dataclass
class Launched:
    """What a step's forward left on the device for its sampling (set while it is launched)."""

    bucket: int | None = None  # the graph bucket replayed; None: eager
    sample_slots: torch.Tensor | None = None  # a graph step's sampling slots, on the device already
    input_ids: torch.Tensor | None = None  # the step's input ids, a verify step's drafts in
    positions: torch.Tensor | None = None
    chained: bool = False  # chained verify rows: their positions are known on the device only


def dllm_block_index(batch: ForwardBatch, block_size: int) -> np.ndarray:
    """[S * block size] the tokens of each sampled row's block (its last block-size tokens)."""
    ends = np.cumsum(batch.extend_lens)[batch.sample_mask]
    if (batch.extend_lens[batch.sample_mask] < block_size).any():
        raise ValueError(f"DLLM_EXTEND: a sampled row carries fewer tokens than a block ({block_size})")
    return (ends[:, None] - block_size + np.arange(block_size)).reshape(-1)


class StepSampler:
    def __init__(self, slots: SlotState, kernel_ops: KernelOps, device: torch.device,
                 agreed: Callable[[torch.Tensor], torch.Tensor] | None = None, dllm: DllmSpec | None = None) -> None:
        """``agreed``: a tensor-parallel engine's broadcast of rank 0's tokens (None: one rank).
        ``dllm``: a block-diffusion model's block: its steps unmask blocks."""
        self.slots = slots
        self.kernel_ops = kernel_ops
        self.device = device
        self.agreed = agreed
        self.dllm = dllm

    def result(self, batch: ForwardBatch, logits: torch.Tensor, step: Launched) -> PendingResult[ForwardResult]:
        """Sample ``batch``'s rows from ``logits`` [S, V]; each row's token goes to ``last_token``."""
        bucket = step.bucket
        if logits.shape[0] == 0:
            empty = ForwardResult(next_token_ids=np.zeros(0, dtype=np.int64), cuda_graph_bucket=bucket)
            return PendingResult([], lambda _: empty)
        if self.dllm is not None:
            return self._unmasked(batch, logits, self.dllm)
        slots, seq_lens = batch.sample_rows()
        slots_dev = step.sample_slots if step.sample_slots is not None else upload([slots], self.device)[0]
        verify = batch.forward_mode == ForwardMode.TARGET_VERIFY
        if self.slots.is_plain_greedy(slots):
            next_ids = self.kernel_ops.argmax(logits, self.slots.last_token, slots_dev)
            if self.agreed is not None:
                next_ids = self.agreed(next_ids)
                self.slots.last_token[slots_dev] = next_ids
            if verify:
                return self._accept(batch, next_ids, [], step)
            return PendingResult([next_ids], lambda h: ForwardResult(next_token_ids=h[0], cuda_graph_bucket=bucket))
        st, want_logprobs = self.slots.sampling_tensors(slots, seq_lens)
        if step.chained:
            assert step.positions is not None
            st = dataclasses.replace(st, positions=step.positions + 1)
        logits = logits.float()  # sampling and log-probabilities in fp32 (greedy needs no conversion)
        raw = logits
        if st.any_penalties:
            history = self.slots.token_ids[slots_dev, : int(seq_lens.max())]
            (prompt_lens,) = upload([self.slots.prompt_len[slots]], self.device)
            logits = sampler.apply_penalties(logits, history, prompt_lens, st.positions, st)
        next_ids = sampler.sample(logits, st, self.kernel_ops.sample_sorted)
        if self.agreed is not None:
            next_ids = self.agreed(next_ids)
        self.slots.last_token[slots_dev] = next_ids
        if verify:
            return self._accept(batch, next_ids, list(sampler.compute_logprobs(raw, next_ids, st.max_top_n))
                                if want_logprobs else [], step)
        if not want_logprobs:
            return PendingResult([next_ids], lambda h: ForwardResult(next_token_ids=h[0], cuda_graph_bucket=bucket))
        lp = sampler.compute_logprobs(raw, next_ids, st.max_top_n)
        return PendingResult(
            [next_ids, lp.chosen, lp.top_ids, lp.top_values],
            lambda h: ForwardResult(next_token_ids=h[0], logprobs=h[1], top_logprob_ids=h[2],
                                    top_logprob_values=h[3], cuda_graph_bucket=bucket),
        )

    def _unmasked(self, batch: ForwardBatch, logits: torch.Tensor, dllm: DllmSpec) -> PendingResult[ForwardResult]:
        """Each sampled block's tokens, one a position from that position's logits (argmax at temperature 0,
        else a seeded draw at its position: batch-independent), and their probabilities (at the request's
        temperature, before top-k/top-p)."""
        size = dllm.block_size
        slots = np.repeat(batch.req_pool_indices[batch.sample_mask], size)
        positions = batch.positions[dllm_block_index(batch, size)]
        logits = logits.float()
        logits[:, dllm.mask_token_id] = float("-inf")  # a position is never unmasked to the mask itself
        if self.slots.is_plain_greedy(slots):
            probs = torch.softmax(logits, dim=-1)
            conf, next_ids = probs.max(dim=-1)
        else:
            st, _ = self.slots.sampling_tensors(slots, positions)
            next_ids = sampler.sample(logits, st, self.kernel_ops.sample_sorted)
            temp = torch.where(st.temperatures > 0, st.temperatures, torch.ones_like(st.temperatures))
            conf = torch.softmax(logits / temp[:, None], dim=-1).gather(1, next_ids[:, None])[:, 0]
        return PendingResult([next_ids, conf],
                             lambda h: ForwardResult(next_token_ids=h[0], confidences=h[1].astype(np.float32)))

    def _accept(self, batch: ForwardBatch, next_ids: torch.Tensor, logprobs: list[torch.Tensor],
                step: Launched) -> PendingResult[ForwardResult]:
        """A verify step's result: the target's token after every input token, each drawn as a
        non-speculative step would draw it, and how many drafts each request keeps (those equal to
        the target's token before them: for one-hot drafts, rejection sampling exactly). The
        request's last kept token goes to ``last_token``, where a chained next step starts, and its
        length to ``fill_len``."""
        starts = np.cumsum(batch.extend_lens) - batch.extend_lens
        starts_dev, lens, slots = upload([starts, batch.extend_lens, batch.req_pool_indices], self.device)
        assert step.input_ids is not None and step.positions is not None  # the step's tokens, drafts included
        accepted = self.kernel_ops.accept_runs(next_ids, step.input_ids, step.positions, starts_dev, lens, slots,
                                               self.slots.last_token, self.slots.fill_len,
                                               int(batch.extend_lens.max()))
        bucket = step.bucket

        def build(h: list[np.ndarray]) -> ForwardResult:
            lp: list[np.ndarray | None] = [*h[2:]] if logprobs else [None, None, None]
            return ForwardResult(next_token_ids=h[0], accepted_lengths=h[1], logprobs=lp[0], top_logprob_ids=lp[1],
                                 top_logprob_values=lp[2], cuda_graph_bucket=bucket)
        return PendingResult([next_ids, accepted, *logprobs], build)
