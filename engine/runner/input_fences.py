"""When the device has taken a step's host buffers, so that a later step may write them again.

Attention plans reuse their host buffers, so a step waits until the device had the buffers of the
steps before it; this only waits if the device is more than a step behind. With a split prefill's
slices on a stream of their own there are two lanes, the slices' and the main stream's. A decode step
beside the slices shares no buffer with them (the decode wrappers have their own), and a slice after
its split's first plans the very bytes the slice before it planned: either waits for the main lane
alone, so that slices queue up on their stream while the decodes go on.
"""

from __future__ import annotations

import torch

from ..forward_batch import ForwardBatch
from ..forward_mode import ForwardMode
from .side_stream import runs_beside


def on_side_lane(batch: ForwardBatch) -> bool:
    """Whether ``batch`` runs on the slices' lane (with ``enable_split_prefill_overlap``)."""
    return batch.forward_mode == ForwardMode.SPLIT_PREFILL


def _continues_split(batch: ForwardBatch) -> bool:
    return batch.split_layers is not None and batch.split_layers.begin > 0


class InputFences:
    def __init__(self, device: torch.device, two_lanes: bool) -> None:
        """``two_lanes``: a split prefill's slices run on a side stream."""
        self._cuda = device.type == "cuda"
        self._two_lanes = two_lanes
        self._consumed: dict[bool, torch.cuda.Event] = {}  # lane (the slices' or not) -> its last step's

    def wait(self, batch: ForwardBatch) -> None:
        """Before ``batch`` writes host buffers: the device had those of the steps it shares them with."""
        main_only = self._two_lanes and (runs_beside(batch) or _continues_split(batch))
        for lane in (False,) if main_only else (False, True):
            event = self._consumed.pop(lane, None)
            if event is not None:
                event.synchronize()

    def mark(self, batch: ForwardBatch) -> None:
        """``batch``'s host buffers are queued for the device (on the current stream)."""
        if self._cuda:
            event = self._consumed[self._two_lanes and on_side_lane(batch)] = torch.cuda.Event()
            event.record()
