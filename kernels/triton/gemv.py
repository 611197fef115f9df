"""Matrix-vector product for one-token steps (batch-1 decode) as a Triton kernel: y = x W^T (+ b).

At batch 1 a linear layer only streams its weight matrix; cuBLAS's kernels for that shape leave
much of the read bandwidth unused on small models' matrices (a split-K reduce kernel and few bytes
in flight per SM). Here each program owns ``BLOCK_N`` output rows, streams their
weights in ``BLOCK_K`` tiles through a software pipeline, accumulates the products per element in
fp32 and reduces once at the end; the tile shape is autotuned per (N, K). ``choose_gemv``
(``engine/models/linear.py``) times this against ``torch.nn.functional.linear`` once per weight
shape and keeps it unless cuBLAS is faster by more than 3% (a tie goes to the GEMV: in a decode step
it launches with PDL and can carry the add+norm epilogue, which a call timed alone does not see).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..graph_timing import cold_weight_seconds
from .norm import _normalize
from .pdl import pdl_enabled, pdl_release, pdl_wait

# the fp32 accumulator is a whole tile: at most 32 registers a thread (4 warps up to 4k elements, 8 above)
CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4 if bn * bk <= 4096 else 8, num_stages=stages)
    for bn, bk in ((4, 512), (8, 256), (8, 512), (16, 256), (16, 512), (32, 256),
                   (4, 1024), (8, 1024), (32, 128), (64, 128)) for stages in (3, 4)
]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 # with ADD_NORM: the residual [N] (read), the new residual and the normalised sum (written),
                 # the norm's weight, eps, and a counter (int32, zero between launches)
                 r_ptr, r_out_ptr, norm_out_ptr, norm_w_ptr, eps, counter_ptr,
                 HAS_BIAS: tl.constexpr, ADD_NORM: tl.constexpr, BLOCK_NORM: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    # the first weight tile is constant data: with PDL it streams in while the kernel that writes x
    # (a norm, an attention merge) still runs
    cols = tl.arange(0, BLOCK_K)
    col_mask = cols < K
    w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
    # products accumulate per element and reduce across the tile once, after the loop (a reduction
    # per tile costs shuffles and a barrier for every BLOCK_K columns)
    acc2d = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
        acc2d += w.to(tl.float32) * x.to(tl.float32)[None, :]
    acc = tl.sum(acc2d, axis=1)
    # the next kernel may launch now, during this one's tail (not at the start: then every GEMV of a
    # chain becomes resident at once and loads its first tile early, which slows the chain)
    pdl_release(USE_PDL)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_mask)
    if ADD_NORM:
        # the program that finishes last adds the residual and normalises the whole row (what
        # add_rms_norm would do in a kernel of its own); y is read back past L1 (other SMs wrote it)
        tl.debug_barrier()  # every thread's stores precede the count (the atomic releases them at gpu scope)
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            ncols = tl.arange(0, BLOCK_NORM)
            nmask = ncols < N
            yrow = tl.load(y_ptr + ncols, mask=nmask, other=0.0, cache_modifier=".cg").to(tl.float32)
            rrow = tl.load(r_ptr + ncols, mask=nmask, other=0.0).to(tl.float32)
            res_dtype = r_out_ptr.dtype.element_ty
            res = (yrow + rrow).to(res_dtype)  # rounded before it is normalised, as add_rms_norm does
            tl.store(r_out_ptr + ncols, res, mask=nmask)
            out = _normalize(res.to(tl.float32), norm_w_ptr, ncols, nmask, N, eps, res_dtype)
            tl.store(norm_out_ptr + ncols, out.to(norm_out_ptr.dtype.element_ty), mask=nmask)
            tl.store(counter_ptr, 0)


# cache_results: the chosen tile is kept in Triton's cache dir beside the binaries (a carried cache skips the autotune)
_gemv_autotuned = triton.autotune(configs=CONFIGS, key=["N", "K"], cache_results=True)(_gemv_kernel)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int] | None = None) -> torch.Tensor:
    """x: [1, K], weight: [N, K] (rows contiguous), bias: [N] or None -> [1, N] in x's dtype.

    ``config``: (BLOCK_N, BLOCK_K) instead of the autotuned tile (Triton's CPU interpreter cannot time)."""
    y = _output(x, weight)
    _launch(x.contiguous(), weight, bias, y, None, config)
    return y


def gemv_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, counter: torch.Tensor,
                      config: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(gemv(x, weight, bias), residual, norm_weight, eps)`` in one launch, with the same
    numbers: (normalised [1, N], new residual [1, N]). ``counter``: one int32, zero between calls (the
    kernel leaves it so); keep one per call site, also in CUDA graphs."""
    y = _output(x, weight)
    n = weight.shape[0]
    if residual.shape != (1, n) or norm_weight.shape != (n,) or not residual.is_contiguous():
        raise ValueError(f"residual must be a contiguous [1, {n}] and the norm weight [{n}]")
    if counter.dtype != torch.int32 or counter.numel() != 1:
        raise ValueError("counter must be one int32")
    res_dtype = torch.promote_types(y.dtype, residual.dtype)
    new_residual = torch.empty(1, n, dtype=res_dtype, device=x.device)
    out = torch.empty(1, n, dtype=torch.promote_types(res_dtype, norm_weight.dtype), device=x.device)
    _launch(x.contiguous(), weight, bias, y, (residual, new_residual, out, norm_weight.contiguous(), eps, counter),
            config)
    return out, new_residual


def _output(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y [1, N] for a valid (x, weight)."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv takes x [1, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous")
    return torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
            add_norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor] | None,
            config: tuple[int, int] | None) -> None:
    n, k = weight.shape
    b = bias if bias is not None else weight  # never read without HAS_BIAS
    r, r_out, norm_out, norm_w, eps, counter = add_norm if add_norm is not None else (y, y, y, y, 0.0, y)
    pdl = pdl_enabled(x.device)
    args = (x, weight, b, y, n, k, weight.stride(0), r, r_out, norm_out, norm_w, eps, counter)
    flags = {"HAS_BIAS": bias is not None, "ADD_NORM": add_norm is not None,
             "BLOCK_NORM": triton.next_power_of_2(n) if add_norm is not None else 1, "USE_PDL": pdl, "launch_pdl": pdl}
    if config is not None:
        block_n, block_k = config
        _gemv_kernel[(triton.cdiv(n, block_n),)](*args, BLOCK_N=block_n, BLOCK_K=block_k, **flags)
        return
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_autotuned[grid](*args, **flags)


def gemv_keeps_up(weight: torch.Tensor, bias: torch.Tensor | None, repeats: int = 50) -> tuple[bool, float, float]:
    """Time ``gemv`` (autotuned) and ``torch.nn.functional.linear`` on one row with this weight, each
    in a CUDA graph of ``repeats`` calls on copies of the weight past L2 (``cold_weight_seconds``):
    (gemv at most 3% slower, gemv µs, linear µs). A tie goes to the GEMV: in a decode step it also
    launches with PDL (cuBLAS serialises the kernels around it) and can carry the add+norm epilogue,
    which a call timed alone does not see."""
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    times = []
    for fn in (lambda w: gemv(x, w, bias), lambda w: torch.nn.functional.linear(x, w, bias)):
        fn(weight)  # autotunes / picks a cuBLAS kernel outside the graph
        times.append(cold_weight_seconds(fn, weight, repeats) * 1e6)
    return times[0] <= 1.03 * times[1], times[0], times[1]
