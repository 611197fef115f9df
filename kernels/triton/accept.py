"""A verify step's greedy acceptance as one Triton kernel, one program a request (same contract as
``kernels.accept.accept_runs``). In torch it is about twenty launches after the verify step's forward;
at batch 1 their launch latency, not their few bytes, is what they cost."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue


@triton.jit
def _accept_kernel(sampled_ptr, ids_ptr, pos_ptr, starts_ptr, lens_ptr, slots_ptr, last_ptr, fill_ptr, out_ptr,
                   BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    b = tl.program_id(0)
    start = tl.load(starts_ptr + b)
    n = tl.load(lens_ptr + b)
    j = tl.arange(0, BLOCK)
    is_draft = j < n - 1  # the run's drafts follow its first token
    target = tl.load(sampled_ptr + start + j, mask=is_draft, other=0)
    draft = tl.load(ids_ptr + start + 1 + j, mask=is_draft, other=0)
    miss = (target != draft) | (j >= n - 1)  # past the drafts: the run ends there
    kept = tl.min(tl.where(miss, j, BLOCK), axis=0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    tl.store(last_ptr + slot, tl.load(sampled_ptr + start + kept))
    tl.store(fill_ptr + slot, tl.load(pos_ptr + start) + kept + 2)
    tl.store(out_ptr + b, kept)


def accept_runs(sampled: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor,
                lens: torch.Tensor, slots: torch.Tensor, last_token: torch.Tensor, fill_len: torch.Tensor,
                max_len: int) -> torch.Tensor:
    """See ``kernels.accept.accept_runs``; every tensor int64 and contiguous on one device; ``max_len``:
    at least the longest run (the block of lanes a program compares)."""
    tensors = (sampled, input_ids, positions, starts, lens, slots, last_token, fill_len)
    if any(t.dtype != torch.int64 or t.dim() != 1 or t.stride(0) != 1 for t in tensors):
        raise ValueError("accept_runs takes contiguous 1-d int64 tensors")
    if not (sampled.shape == input_ids.shape == positions.shape) or not (starts.shape == lens.shape == slots.shape):
        raise ValueError("accept_runs: sampled, input_ids and positions a token each; starts, lens and slots a request each")
    out = torch.empty_like(starts)
    if starts.shape[0] == 0:
        return out
    _accept_kernel[(starts.shape[0],)](sampled, input_ids, positions, starts, lens, slots, last_token, fill_len, out,
                                       BLOCK=max(16, triton.next_power_of_2(max_len)), num_warps=1,
                                       **pdl_args(sampled.device))
    return out
