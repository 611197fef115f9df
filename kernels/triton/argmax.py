"""Row-wise argmax over a large vocabulary as two Triton kernels: many programs per row each find
the first maximum of a chunk, then one program per row picks the first maximum among the chunks.

``torch.argmax`` reduces a row in one thread block, which at batch 1 leaves most of the device idle
and takes far longer than reading the row. Same contract as
``kernels.ops.argmax``: the index of the first maximum (rows without NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue

CHUNK = 4096  # logits per program in the first pass


@triton.jit
def _chunk_argmax_kernel(x_ptr, val_ptr, idx_ptr, V, stride_row, num_chunks,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    start = chunk * CHUNK
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = start + lanes  # ties among -inf keep the first column, as torch does
    for off in range(0, CHUNK, BLOCK):
        cols = start + off + lanes
        x = tl.load(x_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        take = x > best_v  # strict: a lane keeps its earlier column on ties
        best_v = tl.where(take, x, best_v)
        best_i = tl.where(take, cols, best_i)
    m = tl.max(best_v, axis=0)
    i = tl.min(tl.where(best_v == m, best_i, 2147483647), axis=0)
    tl.store(val_ptr + row * num_chunks + chunk, m)
    tl.store(idx_ptr + row * num_chunks + chunk, i)


@triton.jit
def first_of_chunk_maxima(val_ptr, idx_ptr, row, num_chunks, BLOCK: tl.constexpr):
    """A chunked argmax's second pass for one row: of the ``num_chunks`` (<= BLOCK) chunk maxima at
    ``val_ptr`` and their indices at ``idx_ptr`` (both [rows, num_chunks]), the index of the first
    maximum (int32)."""
    lanes = tl.arange(0, BLOCK)
    mask = lanes < num_chunks
    v = tl.load(val_ptr + row * num_chunks + lanes, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + lanes, mask=mask, other=2147483647)
    m = tl.max(v, axis=0)
    return tl.min(tl.where(v == m, i, 2147483647), axis=0)


@triton.jit
def _row_argmax_kernel(val_ptr, idx_ptr, out_ptr, into_ptr, at_ptr, num_chunks,
                       BLOCK: tl.constexpr, SCATTER: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    best = first_of_chunk_maxima(val_ptr, idx_ptr, row, num_chunks, BLOCK).to(tl.int64)
    tl.store(out_ptr + row, best)
    if SCATTER:
        tl.store(into_ptr + tl.load(at_ptr + row), best)


def argmax(x: torch.Tensor, into: torch.Tensor | None = None, at: torch.Tensor | None = None) -> torch.Tensor:
    """x: [S, V] (last dim contiguous) -> [S] int64, the first maximum of each row; with ``into`` (int64)
    and ``at`` ([S] int64 indices into it) the result is also written at ``into[at]`` (by the same
    launch: the engine's "last token of each slot")."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"argmax takes [S, V] with a contiguous last dim, got shape {tuple(x.shape)}")
    rows, vocab = x.shape
    if into is not None and (at is None or at.shape != (rows,) or at.dtype != torch.int64
                             or into.dtype != torch.int64 or not into.is_contiguous()):
        raise ValueError("argmax's into/at must be a contiguous int64 tensor and [S] int64 indices")
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    vals = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    idxs = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    _chunk_argmax_kernel[(rows, num_chunks)](x, vals, idxs, vocab, x.stride(0), num_chunks,
                                             CHUNK=CHUNK, BLOCK=1024, num_warps=4, **pdl_args(x.device))
    _row_argmax_kernel[(rows,)](vals, idxs, out, out if into is None else into, out if at is None else at, num_chunks,
                                BLOCK=triton.next_power_of_2(num_chunks), SCATTER=into is not None, num_warps=1,
                                **pdl_args(x.device))
    return out
