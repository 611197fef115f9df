"""A second CUDA stream for a split prefill's slices (``enable_split_prefill_overlap``), so that the
decode steps' graphs that take turns with them run on the main stream beside them instead of after.

A slice reads what earlier non-decode steps wrote (its prompt's cached or chunked KV, the slot table):
its stream waits for the main stream as of the last such step, not for the decode steps since. The
main stream waits for the slices before a step that is not a decode (it may plan or write what a
slice uses), before slots a split held are released (their KV slots go to other requests), and
before the last slice's logits are sampled. On CPU there is one stream and nothing to order."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..forward_batch import ForwardBatch
from ..forward_mode import ForwardMode

# steps that neither write nor plan anything a slice reads, so they may run beside one
_BESIDE = (ForwardMode.DECODE, ForwardMode.IDLE)


class SideStream:
    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._mark: torch.cuda.Event | None = None  # the main stream after its last step a slice may read

    def before(self, batch: ForwardBatch) -> None:
        """Before a main-stream step: wait for the slices where it may touch what they use."""
        if self.stream is not None and (batch.forward_mode not in _BESIDE or batch.released_slots):
            torch.cuda.current_stream().wait_stream(self.stream)

    def after(self, batch: ForwardBatch) -> None:
        """After a main-stream step is queued: where the next slice starts from, unless it was a decode."""
        if self.stream is not None and batch.forward_mode not in _BESIDE:
            self._mark = torch.cuda.current_stream().record_event()

    @contextlib.contextmanager
    def slice(self) -> Iterator[None]:
        """Queue a slice's whole step (uploads, slot-table writes, layers) on the side stream."""
        if self.stream is None:
            yield
            return
        if self._mark is not None:
            self.stream.wait_event(self._mark)
        with torch.cuda.stream(self.stream):
            yield

    def hand_over(self, logits: torch.Tensor) -> torch.Tensor:
        """A last slice's logits, for the main stream to sample from."""
        if self.stream is not None and logits.shape[0]:
            main = torch.cuda.current_stream()
            main.wait_stream(self.stream)
            logits.record_stream(main)
        return logits
