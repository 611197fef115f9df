"""SPLIT_PREFILL on the engine: a prefill's layers a slice a step, its hidden state kept between slices.

The first slice embeds the tokens, each slice runs its layers (writing their KV), and the last returns
the final-normed hidden states for the logits. Between slices the engine keeps the next layer's input
and the residual of the batch's tokens; they go when the last slice ran, when a new split starts on
one of their slots, or when the scheduler releases the slots (abort or preemption in the middle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..forward_batch import ForwardBatch, LayerRange
from ..models.llama import LlamaForCausalLM
from ...kernels.attention.base import AttentionBackend


@dataclass
class _Held:
    slots: tuple[int, ...]  # the batch's request slots, in batch order
    num_tokens: int
    next_layer: int
    x: torch.Tensor  # [T, hidden] layer ``next_layer``'s normalised input
    residual: torch.Tensor  # [T, hidden]


class SplitPrefill:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._held: _Held | None = None

    @property
    def held_slots(self) -> tuple[int, ...]:
        """The slots whose split prefill is between two slices."""
        return self._held.slots if self._held is not None else ()

    def release(self, slots: tuple[int, ...]) -> None:
        """Drop the hidden state of a split prefill on any of ``slots``."""
        if self._held is not None and set(slots) & set(self._held.slots):
            self._held = None

    def check(self, batch: ForwardBatch) -> LayerRange:
        """The batch's layer range; ``ValueError`` unless it starts a split or continues the held one."""
        layers = batch.split_layers
        if layers is None or not 0 <= layers.begin < layers.end <= self.num_layers:
            raise ValueError(f"a SPLIT_PREFILL step needs layers [begin, end) within [0, {self.num_layers}), "
                             f"got {layers}")
        if layers.begin == 0:
            return layers
        held, slots = self._held, tuple(batch.req_pool_indices.tolist())
        if held is None or held.slots != slots or held.num_tokens != batch.num_tokens or held.next_layer != layers.begin:
            expect = "no split prefill is held" if held is None else (
                f"the held one is of slots {list(held.slots)}, {held.num_tokens} tokens, next layer {held.next_layer}")
            raise ValueError(f"SPLIT_PREFILL layers [{layers.begin}, {layers.end}) of slots {list(slots)} "
                             f"({batch.num_tokens} tokens) continue no split prefill: {expect}")
        return layers

    def run(self, model: LlamaForCausalLM, batch: ForwardBatch, input_ids: torch.Tensor, positions: torch.Tensor,
            attn: AttentionBackend) -> torch.Tensor | None:
        """This slice of ``batch`` (``check``ed, attention metadata set already): the final hidden states
        [T, hidden] after the last layer, else None (the state kept for the next slice)."""
        layers = batch.split_layers
        assert layers is not None
        if layers.begin == 0:  # one split prefill at a time: a new one replaces any left behind
            self._held = None
            x, residual = model.embed(input_ids)
        else:
            assert self._held is not None
            x, residual = self._held.x, self._held.residual
            self._held = None
        x, residual = model.run_layers(x, residual, positions, attn, layers.begin, layers.end)
        if layers.end == self.num_layers:
            return x
        self._held = _Held(tuple(batch.req_pool_indices.tolist()), batch.num_tokens, layers.end, x, residual)
        return None
