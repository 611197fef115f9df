"""A second CUDA stream for a split prefill's slices (``enable_split_prefill_overlap``), so that the
decode steps' graphs that take turns with them run beside them instead of after, on a stream of higher
priority than the slices' (``beside``): the GPU gives freed SMs to a decode's kernels before a slice's next
blocks, so a slice's large GEMMs do not hold a decode back by more than the blocks already running.
With ``split_prefill_overlap_sms`` the slices' stream belongs to a CUDA green context of that many SMs (or
fewer: the others are split off as one group, in the driver's granularity), so that kernels which keep
every SM they are given (persistent GEMMs) leave the others to the decodes. The slices get the split's
remainder and the decodes' SMs stay a group because a split's groups can host thread-block clusters and
its remainder need not: a decode's cluster GEMM that finds no room for a cluster among the SMs a slice
leaves waits for that slice's kernel to end. The decodes run in the primary context, on any SM, unless
``confine_decodes``: then, while a slice may still run, on a stream of the group's own green context
(their kernels take none of the slices' SMs, so the slices keep the speed of their share alone), and on
any SM again once the slices queued so far are done. A decode graph captured in the primary context
runs there whatever stream replays it, so the decode graphs are captured on the group's stream as
well (``group``), and a step replays those while ``confining``.

A slice reads what earlier non-decode steps wrote (its prompt's cached or chunked KV, the slot table):
its stream waits for the main stream as of the last such step, not for the decode steps since. The
main stream waits for the slices before a step that is not a decode (it may plan or write what a
slice uses), and before slots a split held are released (their KV slots go to other requests). A slice's whole
launch, the last one's sampling and result copies included, stays on the side stream, so its result is
ready when the slice is, whatever the decodes beside it are doing. On CPU there is one stream and
nothing to order."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, NamedTuple

import torch

from ..forward_batch import ForwardBatch
from ..forward_mode import ForwardMode

logger = logging.getLogger(__name__)

# steps that neither write nor plan anything a slice reads, so they may run beside one
_BESIDE = (ForwardMode.DECODE, ForwardMode.IDLE)


# CUDA stream priorities: lower is higher; 0 is the default streams' (the lowest)
_DECODE_PRIORITY = -1


def runs_beside(batch: ForwardBatch) -> bool:
    """Whether ``batch`` may run beside a split's slices (it neither writes nor plans anything they read)."""
    return batch.forward_mode in _BESIDE


class Partition(NamedTuple):
    """A green-context split of a device's SMs: the slices' stream on the remainder, the others' group."""

    slices: torch.cuda.Stream
    slice_sms: int
    group: torch.cuda.Stream  # runs on the SMs the slices leave only


def partitioned_stream(device: torch.device, num_sms: int) -> Partition:
    """A stream whose kernels run on ``num_sms`` of ``device``'s SMs, or fewer (the remainder of a green-context
    split that leaves the others one group, as the module says), the number of SMs it has, and a stream of
    the others' group."""
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < num_sms < total:
        raise ValueError(f"split_prefill_overlap_sms must leave SMs to the decode steps: 0 < it < {total}, got {num_sms}")
    try:
        from flashinfer.green_ctx import split_device_green_ctx_by_sm_count
    except ImportError as exc:  # FlashInfer's green contexts need cuda-python's driver bindings
        raise ValueError(f"split_prefill_overlap_sms needs CUDA green contexts (flashinfer.green_ctx): {exc}") from exc
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        streams, resources = split_device_green_ctx_by_sm_count(torch.device("cuda", index), [total - num_sms])
    except RuntimeError as exc:  # a count the driver cannot split off
        raise ValueError(f"split_prefill_overlap_sms={num_sms}: {exc}") from exc
    if resources[1].sm.smCount == 0:
        raise ValueError(f"split_prefill_overlap_sms={num_sms} leaves no SM to the slices once the others are "
                         f"rounded to the driver's granularity (8 SMs on Hopper)")
    logger.info("split prefill slices on %d of %d SMs (%d asked for)", resources[1].sm.smCount, total, num_sms)
    return Partition(streams[1], int(resources[1].sm.smCount), streams[0])


class SideStream:
    def __init__(self, device: torch.device, num_sms: int = 0, confine_decodes: bool = False) -> None:
        """``num_sms`` > 0: the slices run on that many SMs (CUDA only), the decode steps on any, or with
        ``confine_decodes`` on the others while a slice may run."""
        if confine_decodes and not num_sms:
            raise ValueError("confine_decodes needs the SMs split: num_sms > 0")
        cuda = device.type == "cuda"
        self.stream: torch.cuda.Stream | None = None
        self.slice_sms = 0  # the SMs the slices' kernels run on (CUDA)
        self.group: torch.cuda.Stream | None = None  # the decodes' stream while a slice may run (confined)
        self._slices_queued: torch.cuda.Event | None = None  # the slice stream after its last slice so far
        if cuda and num_sms:
            self.stream, self.slice_sms, group = partitioned_stream(device, num_sms)
            self.group = group if confine_decodes else None
        elif cuda:
            self.stream = torch.cuda.Stream(device)
            self.slice_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.decode_stream = torch.cuda.Stream(device, priority=_DECODE_PRIORITY) if cuda else None
        self._mark: torch.cuda.Event | None = None  # the main stream after its last step a slice may read

    @contextlib.contextmanager
    def lane(self, batch: ForwardBatch) -> Iterator[None]:
        """The stream ``batch``'s launch runs on, ordered with the others as the module says."""
        if batch.forward_mode == ForwardMode.SPLIT_PREFILL:
            with self._slice():
                yield
            return
        with self._beside(batch):
            self._before(batch)
            yield
            self._after(batch)

    @contextlib.contextmanager
    def _beside(self, batch: ForwardBatch) -> Iterator[None]:
        """A decode step's whole launch (inputs, layers, sampling, result copies) on the high-priority
        stream, in order with the main stream on both sides; other steps as they are."""
        if self.decode_stream is None or not runs_beside(batch):
            yield
            return
        main, lane = torch.cuda.current_stream(), self._decode_lane()
        lane.wait_stream(main)
        with torch.cuda.stream(lane):
            yield
        main.wait_stream(lane)

    @property
    def confining(self) -> bool:
        """Whether the step being queued goes on the group's stream (the SMs the slices leave)."""
        return self.group is not None and torch.cuda.current_stream() == self.group

    def _decode_lane(self) -> torch.cuda.Stream:
        """The confined group's stream while a slice queued so far may still run (a query, no wait), else
        the high-priority stream on every SM."""
        assert self.decode_stream is not None
        if self.group is not None and self._slices_queued is not None and not self._slices_queued.query():
            return self.group
        return self.decode_stream

    def _before(self, batch: ForwardBatch) -> None:
        """Before a main-stream step: wait for the slices where it may touch what they use."""
        if self.stream is not None and (not runs_beside(batch) or batch.released_slots):
            torch.cuda.current_stream().wait_stream(self.stream)

    def _after(self, batch: ForwardBatch) -> None:
        """After a main-stream step is queued: where the next slice starts from, unless it was a decode."""
        if self.stream is not None and not runs_beside(batch):
            self._mark = torch.cuda.current_stream().record_event()

    @contextlib.contextmanager
    def _slice(self) -> Iterator[None]:
        """Queue a slice's whole step (uploads, slot-table writes, layers; the last one's sampling and
        result copies) on the side stream."""
        if self.stream is None:
            yield
            return
        if self._mark is not None:
            self.stream.wait_event(self._mark)
        with torch.cuda.stream(self.stream):
            yield
        if self.group is not None:
            self._slices_queued = self.stream.record_event()

    def hand_over(self, logits: torch.Tensor) -> torch.Tensor:
        """A last slice's logits, for a caller on the main stream (``ModelRunner.compute_logits``)."""
        if self.stream is not None and logits.shape[0]:
            main = torch.cuda.current_stream()
            main.wait_stream(self.stream)
            logits.record_stream(main)
        return logits
