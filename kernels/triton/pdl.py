"""Programmatic dependent launch (PDL) for the decoder's Triton kernels.

A decode step at batch 1 is a long chain of short kernels, each waiting for the one before it
to finish, drain and launch. Launched with PDL (Hopper and later), a kernel may start while its
predecessor still runs: its programs become resident and wait in ``griddepcontrol.wait`` until the
predecessor has completed and its writes are visible, so the launch latency, and any work that does
not depend on the predecessor, overlaps the predecessor's tail.

The rules every kernel here keeps:
- it waits (``griddepcontrol.wait``) before it reads anything an earlier kernel wrote and before it
  writes anything, in every program, so a kernel that starts early never races its predecessor,
  and (as each kernel only completes after its wait) never races any kernel before that either;
- it lets its dependents launch (``griddepcontrol.launch_dependents``): the short kernels at once
  (``pdl_prologue``), the GEMV after its main loop (letting a GEMV's dependents launch at once
  slows a chain of GEMVs: every one becomes resident early and loads its first tile).
The GEMV loads its first weight tile before its wait.
Kernels of other libraries (cuBLAS, torch) in between are launched as usual and serialise fully.

It pays at large batches too, where only every other kernel is one of these (norms, rotary, SiLU
between cuBLAS GEMMs and FlashInfer attention): the step's wall time drops although the kernels'
own device time does not (with PDL a kernel's time includes its early wait).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: CUDA devices of compute capability 9.0 and up,
    unless ``MODESERVE_DISABLE_PDL=1`` (read once per device and process). Never in Triton's CPU
    interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _pdl_on(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Launch arguments of a kernel with a ``USE_PDL`` constexpr, on ``device``."""
    pdl = pdl_enabled(device)
    return {"USE_PDL": pdl, "launch_pdl": pdl}


@functools.cache
def _pdl_on(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0) and os.environ.get("MODESERVE_DISABLE_PDL") != "1"


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """Let the next kernel launch now (its programs wait for this kernel's completion themselves)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the kernels before this one have completed and their writes are visible."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """``pdl_release`` then ``pdl_wait``: the start of a kernel that reads nothing constant early."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
