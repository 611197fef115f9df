"""Chained TARGET_VERIFY rows resolved in one launch (same contract as
``kernels.chain_verify.chain_verify_rows``): one program a row moves it to where its last verify step
left it and makes its n-gram drafts.

In torch this is some forty launches a step (the n-gram lookup alone is a compare, reduce and select
per suffix length); at batch 1 their launch latency is what they cost, and a verify step that
overlaps the next one's preparation pays it on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue


@triton.jit
def _history(token_ids_row, i, start, first):
    """Token ``i`` of a row whose tokens are the table's before ``start`` and ``first`` at ``start``."""
    return tl.where(i == start, first, tl.load(token_ids_row + i, mask=i < start, other=-1))


@triton.jit
def _latest_match(token_ids_row, start, first, n: tl.constexpr, BLOCK: tl.constexpr):
    """The latest window start s (its n tokens ending before the last one, ``start``) whose tokens equal
    the row's last n; -1 if none. Scans back from the end a block of starts at a time."""
    length = start + 1
    hi = length - 1 - n  # the latest start a window may have
    latest = hi * 0 - 1
    base = hi - BLOCK + 1
    while (base + BLOCK > 0) & (latest < 0):
        s = base + tl.arange(0, BLOCK)
        ok = (s >= 0) & (s <= hi)
        for j in tl.static_range(n):
            want = _history(token_ids_row, length - n + j, start, first)
            got = tl.load(token_ids_row + s + j, mask=ok, other=-1)  # s + j < start: the table's
            ok = ok & (got == want)
        latest = tl.max(tl.where(ok, s, -1), axis=0)
        base -= BLOCK
    return latest


@triton.jit
def _chain_verify_kernel(req_to_token_ptr, token_ids_ptr, last_token_ptr, fill_len_ptr, slots_ptr, rows_ptr,
                         tokens_ptr, pos_ptr, seq_lens_ptr, loc_ptr, ids_ptr, q, max_context, stride_table, stride_ids,
                         MIN_N: tl.constexpr, MAX_N: tl.constexpr, Q_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    c = tl.program_id(0)
    slot = tl.load(slots_ptr + c)
    row = tl.load(rows_ptr + c)
    j = tl.arange(0, Q_BLOCK)
    jm = j < q
    tok = tl.load(tokens_ptr + c * q + j, mask=jm, other=0)
    host_pos = tl.load(pos_ptr + tok, mask=jm, other=0)
    table_row = req_to_token_ptr + slot * stride_table
    tl.store(table_row + host_pos, tl.load(loc_ptr + tok, mask=jm, other=0), mask=jm)  # the reserved slots
    tl.debug_barrier()  # written before they are read back below, at the row's own positions
    start = tl.minimum(tl.maximum(tl.load(fill_len_ptr + slot) - 1, 0), max_context - q)  # inside the table
    back = tl.sum(tl.where(j == 0, host_pos, 0), axis=0) - start
    pos = start + j
    tl.store(pos_ptr + tok, pos, mask=jm)
    tl.store(seq_lens_ptr + row, tl.load(seq_lens_ptr + row) - back)
    tl.store(loc_ptr + tok, tl.load(table_row + pos, mask=jm, other=0), mask=jm)
    first = tl.load(last_token_ptr + slot)
    ids_row = token_ids_ptr + slot * stride_ids
    after = start * 0 - 1
    for n in tl.static_range(MIN_N, MAX_N + 1):  # longer suffixes override shorter ones
        if n < start + 1:
            latest = _latest_match(ids_row, start, first, n, BLOCK)
            after = tl.where(latest >= 0, latest + n, after)
    at = tl.minimum(tl.where(after >= 0, after + j - 1, start), start)  # the draft of query j >= 1
    draft = _history(ids_row, at, start, first)
    tl.store(ids_ptr + tok, tl.where(j == 0, first, draft), mask=jm)


def chain_verify_rows(req_to_token: torch.Tensor, token_ids: torch.Tensor, last_token: torch.Tensor,
                      fill_len: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                      positions: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                      input_ids: torch.Tensor, width: int, min_n: int, max_n: int) -> None:
    """See ``kernels.chain_verify.chain_verify_rows`` (``width`` unused: each program reads its own row's
    length); every tensor int64 on one device, the tables with contiguous rows, the rest contiguous."""
    tensors = (req_to_token, token_ids, last_token, fill_len, slots, rows, tokens, positions, seq_lens, out_cache_loc,
               input_ids)
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
        raise ValueError("chain_verify_rows takes contiguous int64 tensors")
    num_rows, q = tokens.shape
    if num_rows == 0:
        return
    _chain_verify_kernel[(num_rows,)](req_to_token, token_ids, last_token, fill_len, slots, rows, tokens, positions,
                                      seq_lens, out_cache_loc, input_ids, q, req_to_token.shape[1], req_to_token.stride(0),
                                      token_ids.stride(0), MIN_N=min_n, MAX_N=max_n,
                                      Q_BLOCK=max(16, triton.next_power_of_2(q)), BLOCK=256, num_warps=4,
                                      **pdl_args(input_ids.device))
