"""Host <-> device transfers of a step without waiting on the device.

A step's integer inputs travel in one pinned buffer and one asynchronous copy; its results come
back the same way and are waited for only when the caller asks (``PendingResult.result``), so the
host can prepare and launch the next step while the device still runs this one.
"""

from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

import numpy as np
import torch

T = TypeVar("T")
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}  # what steps upload


def upload(arrays: Sequence[np.ndarray], device: torch.device, dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    """Copy host arrays to ``device`` as ``dtype`` with one asynchronous transfer; same shapes.

    On CUDA the arrays are packed into one pinned buffer (the caching host allocator keeps it alive
    until the copy has run), so the call never waits for the device. On CPU they are wrapped.
    """
    np_dtype = _NUMPY_DTYPES[dtype]
    if device.type != "cuda":  # copies: a step may write its inputs in place (placeholder ids resolved)
        return [torch.from_numpy(np.array(a, dtype=np_dtype)) for a in arrays]
    sizes = [int(a.size) for a in arrays]
    host = torch.empty(max(sum(sizes), 1), dtype=dtype, pin_memory=True)
    view = host.numpy()
    offset = 0
    for a, n in zip(arrays, sizes):
        view[offset : offset + n] = a.reshape(-1)
        offset += n
    dev = host.to(device, non_blocking=True)
    out, offset = [], 0
    for a, n in zip(arrays, sizes):
        out.append(dev[offset : offset + n].view(a.shape))
        offset += n
    return out


def upload_into(host: np.ndarray, dst: torch.Tensor) -> None:
    """Copy ``host`` into the contiguous device tensor ``dst`` (same number of elements and dtype)
    through a pinned buffer, asynchronously (the caching host allocator keeps the buffer until the
    copy has run)."""
    pinned = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True)
    pinned.numpy().reshape(host.shape)[...] = host
    dst.copy_(pinned, non_blocking=True)


class PendingResult(Generic[T]):
    """Device tensors of a launched step on their way to the host.

    ``result()`` waits for the copies (not for later steps) and builds the value with ``build``
    from the host arrays, in the order the tensors were given.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], build: Callable[[list[np.ndarray]], T]) -> None:
        self._build = build
        self._event: torch.cuda.Event | None = None
        if tensors and tensors[0].device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self._host, tensors):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = [t.detach().cpu() for t in tensors]

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> T:
        if self._event is not None:
            self._event.synchronize()
        return self._build([h.numpy() for h in self._host])
