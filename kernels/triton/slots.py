"""A step's token bookkeeping as one Triton kernel (same contract as ``kernels.ops.record_tokens``):
resolve placeholder ids from the slot's last sampled token, record each token's KV slot and id.

In torch this is five launches (compare, gather, select, two scatters) before every step's forward;
at batch 1 their launch latency, not their few bytes, is what they cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue


@triton.jit
def _record_tokens_kernel(req_to_token_ptr, token_ids_ptr, last_token_ptr, rows_ptr, pos_ptr, loc_ptr, ids_ptr, T,
                          stride_table, stride_ids, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < T
    rows = tl.load(rows_ptr + offs, mask=mask, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + offs, mask=mask, other=0).to(tl.int64)
    loc = tl.load(loc_ptr + offs, mask=mask, other=0)
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    placeholder = ids < 0
    ids = tl.where(placeholder, tl.load(last_token_ptr + rows, mask=mask & placeholder, other=0), ids)
    tl.store(ids_ptr + offs, ids, mask=mask)
    tl.store(req_to_token_ptr + rows * stride_table + pos, loc, mask=mask)
    tl.store(token_ids_ptr + rows * stride_ids + pos, ids, mask=mask)


def record_tokens(req_to_token: torch.Tensor, token_ids: torch.Tensor, last_token: torch.Tensor, rows: torch.Tensor,
                  positions: torch.Tensor, loc: torch.Tensor, ids: torch.Tensor) -> None:
    """See ``kernels.ops.record_tokens``; every tensor int64 on one device, the tables with contiguous rows."""
    tensors = (req_to_token, token_ids, last_token, rows, positions, loc, ids)
    if any(t.dtype != torch.int64 for t in tensors) or req_to_token.stride(1) != 1 or token_ids.stride(1) != 1:
        raise ValueError("record_tokens takes int64 tensors and tables with contiguous rows")
    n = ids.shape[0]
    if not (rows.shape == positions.shape == loc.shape == (n,)) or any(t.stride(0) != 1 for t in tensors[3:]):
        raise ValueError("rows, positions, loc and ids must be contiguous [T] tensors of one length")
    if n == 0:
        return
    block = min(1024, max(32, triton.next_power_of_2(n)))
    _record_tokens_kernel[(triton.cdiv(n, block),)](req_to_token, token_ids, last_token, rows, positions, loc, ids, n,
                                                    req_to_token.stride(0), token_ids.stride(0), BLOCK=block,
                                                    num_warps=4, **pdl_args(ids.device))
