"""Linear layers of a few rows (a decode step's batch, up to 64 tokens) as a Triton kernel: y = x W^T (+ b).

cuBLAS's Hopper kernels for these shapes launch thread-block clusters, and a cluster starts only
when all its SMs are free at once. Beside a split prefill's slice on another stream (whose GEMM
tiles hold SMs and free them one by one), such a kernel can wait for the slice's whole GEMM,
whatever its stream's priority (docs/benchmarks.md, "Session 50"). This kernel has no clusters:
each program owns ``BLOCK_N`` output columns for every row, streams their weights in ``BLOCK_K``
tiles through a software pipeline and multiplies on the tensor cores (the rows padded to
``BLOCK_M``, at least 16), so its programs take SMs as they come free. The tile is autotuned per
(N, K, BLOCK_M); ``prepare_small_gemm`` runs the tuning before CUDA graphs are captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..op_set import SMALL_GEMM_MAX_ROWS as MAX_ROWS

CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4, num_stages=stages)
    for bn, bk in ((16, 128), (16, 256), (32, 128), (32, 256), (64, 64), (64, 128), (128, 64))
    for stages in (3, 4)
]


@triton.jit
def _small_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        # the weight tile as [BLOCK_K, BLOCK_N]: column n is row n of W
        w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None],
                    mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        if EXACT:  # fp32 inputs: full-precision products, not TF32's (the fp32 engine checks against torch)
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


# cache_results: the chosen tile is kept in Triton's cache dir beside the binaries
_small_gemm_autotuned = triton.autotune(configs=CONFIGS, key=["N", "K", "BLOCK_M"], cache_results=True)(_small_gemm_kernel)


def block_rows(m: int) -> int:
    """The rows a launch pads ``m`` to (tensor-core tiles take at least 16)."""
    return max(16, triton.next_power_of_2(m))


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               config: tuple[int, int] | None = None) -> torch.Tensor:
    """x: [M, K] with 1 <= M <= 64, weight: [N, K] (rows contiguous), bias: [N] or None -> [M, N] in x's dtype.

    ``config``: (BLOCK_N, BLOCK_K) instead of the autotuned tile (Triton's CPU interpreter cannot time)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"small_gemm takes x [M, K] with 1 <= M <= {MAX_ROWS} and weight [N, K], "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("small_gemm needs the weight's rows contiguous")
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    b = bias if bias is not None else weight  # never read without HAS_BIAS
    args = (x, weight, b, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0))
    flags = {"HAS_BIAS": bias is not None, "EXACT": x.dtype == torch.float32, "BLOCK_M": block_rows(m)}
    if config is not None:
        block_n, block_k = config
        _small_gemm_kernel[(triton.cdiv(n, block_n),)](*args, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **flags)
    else:
        _small_gemm_autotuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    return y


def prepare_small_gemm(weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> None:
    """Tune the tile for this weight at every row bucket up to ``max_rows`` rows (outside graph capture)."""
    top = min(max_rows, MAX_ROWS)
    for rows in sorted({min(block_rows(m), top) for m in range(1, top + 1)}):
        small_gemm(torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device), weight, bias)
