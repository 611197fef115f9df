"""The ranks of one tensor-parallel engine: a device process group for the all-reduces (NCCL on CUDA,
gloo on CPU) and a gloo group on the host for the step's ``ForwardBatch``, which rank 0 receives and
sends to the others. Groups are built from their own TCP store (no default process group), so that a
process may hold several engines, as tests do."""

from __future__ import annotations

import datetime
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) and symmetric-memory multicast stay off unless the environment says otherwise:
# the shared machines do not allow them
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
IDLE_FOREVER = datetime.timedelta(days=365)


def multicast_off_defaults() -> None:
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)


def tp_store(rank: int, size: int, host: str, port: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """The ranks' TCP store on ``host:port``: rank 0 serves it (``port`` 0: a free port, read back as the
    store's ``port``, before the other ranks are told it) and does not wait here for the others; the
    others connect to it."""
    return dist.TCPStore(host, port, size, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class TpGroup:
    def __init__(self, rank: int, store: dist.TCPStore, size: int, device: torch.device,
                 timeout_s: float = 600.0) -> None:
        """``store``: the ranks' (``tp_store``); every rank blocks here until all ``size`` joined."""
        multicast_off_defaults()
        self.rank, self.size, self.device = rank, size, device
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = store
        # Any: the stubs give the backends no collectives (they have them, as every process group does).
        # No timeout that an idle engine could reach: the other ranks wait for rank 0's next batch
        # (a rank that dies closes its connections, which ends the wait at once)
        self._host_group: Any = dist.ProcessGroupGloo(dist.PrefixStore("host", self._store), rank, size,
                                                      IDLE_FOREVER)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self._device_group: Any = dist.ProcessGroupNCCL(dist.PrefixStore("device", self._store), rank, size,
                                                            dist.ProcessGroupNCCL.Options())
        else:
            self._device_group = dist.ProcessGroupGloo(dist.PrefixStore("device", self._store), rank, size, timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place where ``x`` is contiguous)."""
        x = x.contiguous()
        self._device_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` [..., n] side by side along the last dimension, rank 0's first: [..., size * n]."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._device_group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (same shape and dtype everywhere), in place."""
        x = x.contiguous()
        self._device_group.broadcast([x], _root()).wait()
        return x

    def send_step(self, step: Any) -> None:
        """Rank 0: the object every other rank's ``recv_step`` returns (a ``ForwardBatch``, or None to stop)."""
        data = torch.frombuffer(bytearray(pickle.dumps(step)), dtype=torch.uint8)
        self._host_group.broadcast([torch.tensor([data.numel()], dtype=torch.int64)], _root()).wait()
        self._host_group.broadcast([data], _root()).wait()

    def recv_step(self) -> Any:
        n = torch.zeros(1, dtype=torch.int64)
        self._host_group.broadcast([n], _root()).wait()
        data = torch.empty(int(n.item()), dtype=torch.uint8)
        self._host_group.broadcast([data], _root()).wait()
        return pickle.loads(data.numpy().tobytes())


def _root() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts
