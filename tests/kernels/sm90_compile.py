"""Compiles every Triton kernel of the decode and prefill paths for Hopper (sm_90) without a GPU.

Run as a script with ``TRITON_INTERPRET`` unset (so ``triton.jit`` makes real JIT functions): each
kernel wrapper is called on CPU tensors of representative shapes with ``JITFunction.run`` replaced by
a recorder, and each recorded launch is compiled to a cubin with ``triton.compile`` for sm_90, with
``USE_PDL`` on as on an H200. Triton's interpreter runs the kernels' numbers on CPU but not its
compiler front end, whose typing rules (a variable keeps its block shape across an ``if``) it does
not enforce: a kernel can pass every interpreter test and fail to compile. Prints one line a launch
("ok NAME" or "FAIL NAME: error") and exits 1 if any failed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
           torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def compile_launch(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Compile one launch of ``fn`` for sm_90 (what ``fn[grid](*args, **kwargs)`` would build on an H200)."""
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for param in fn.params:
        value = values[param.name] if param.name in values else param.default
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = True if param.name == "USE_PDL" else value
        else:
            signature[param.name] = _type(value)
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32), options=options)


class Recorder:
    """Replaces ``JITFunction.run`` while installed: launches are kept, not run."""

    def __init__(self) -> None:
        self.launches: list[tuple[JITFunction, tuple[Any, ...], dict[str, Any]]] = []
        self._run = JITFunction.run

    def __enter__(self) -> "Recorder":
        launches = self.launches

        def run(fn: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            launches.append((fn, args, kwargs))

        JITFunction.run = run  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        JITFunction.run = self._run  # type: ignore[method-assign]


def _calls() -> None:
    """One call of each kernel wrapper per variant that compiles differently."""
    from modeserve.kernels.triton import (accept, activation, argmax, attention_decode, attention_extend, chain_verify,
                                          gemv, norm, rotary, sampling, slots, small_gemm)

    bf = torch.bfloat16
    d, hq, hkv, slots_n = 128, 8, 2, 64
    x = torch.randn(1, 512, dtype=bf)
    w = torch.randn(256, 512, dtype=bf)
    gemv.gemv(x, w, None, config=(8, 256))
    gemv.gemv(x, w, torch.randn(256, dtype=bf), config=(8, 256))
    gemv.gemv_add_rms_norm(x, w, None, torch.randn(1, 256, dtype=bf), torch.randn(256, dtype=bf), 1e-6,
                           torch.zeros(1, dtype=torch.int32), config=(8, 128))  # BLOCK_K != BLOCK_NORM
    for rows in (3, 32):  # BLOCK_M 16 and 32
        small_gemm.small_gemm(torch.randn(rows, 512, dtype=bf), w, None, config=(32, 128))
    small_gemm.small_gemm(torch.randn(3, 512, dtype=bf), w, torch.randn(256, dtype=bf), config=(64, 64))
    small_gemm.small_gemm(torch.randn(3, 512), w.float(), None, config=(32, 64))  # fp32: IEEE products
    h = torch.randn(3, 256, dtype=bf)
    norm.rms_norm(h, torch.randn(256, dtype=bf), 1e-6)
    norm.add_rms_norm(h, torch.randn(3, 256, dtype=bf), torch.randn(256, dtype=bf), 1e-6)
    activation.silu_and_mul(torch.randn(3, 512, dtype=bf))
    logits = torch.randn(2, 1000, dtype=bf)
    argmax.argmax(logits)
    argmax.argmax(logits, into=torch.zeros(4, dtype=torch.int64), at=torch.zeros(2, dtype=torch.int64))
    table = torch.zeros(4, 32, dtype=torch.int64)
    i64 = lambda n: torch.zeros(n, dtype=torch.int64)  # noqa: E731
    f32 = lambda n: torch.ones(n, dtype=torch.float32)  # noqa: E731
    sampling.sample_sorted(logits.float(), torch.zeros(2, 1000, dtype=torch.int64), i64(2), f32(2), f32(2), i64(2), i64(2))
    slots.record_tokens(table, torch.zeros(4, 32, dtype=torch.int64), i64(4), i64(3), i64(3), i64(3), i64(3))
    for n_range in ((1, 3), (2, 2)):
        chain_verify.chain_verify_rows(table, torch.zeros(4, 32, dtype=torch.int64), i64(4), i64(4), i64(1), i64(1),
                                       torch.zeros(1, 5, dtype=torch.int64), i64(5), i64(1), i64(5), i64(5), 32, *n_range)
    accept.accept_runs(i64(5), i64(5), i64(5), i64(1), torch.full((1,), 5, dtype=torch.int64), i64(1), i64(4), i64(4), 5)
    cos_sin = torch.randn(64, d, dtype=torch.float32)
    q, k, v = torch.randn(3, hq, d, dtype=bf), torch.randn(3, hkv, d, dtype=bf), torch.randn(3, hkv, d, dtype=bf)
    kc, vc = torch.zeros(slots_n, hkv, d, dtype=bf), torch.zeros(slots_n, hkv, d, dtype=bf)
    rotary.apply_rotary(q, k, i64(3), cos_sin)
    rotary.apply_rotary_and_store_kv(q, k, v, i64(3), cos_sin, kc, vc, i64(3))
    rotary.store_kv(kc, vc, i64(3), k, v)
    rows, lens = i64(3), torch.full((3,), 5, dtype=torch.int64)
    os.environ["TRITON_INTERPRET"] = "1"  # past decoration: lets the wrappers accept CPU tensors
    for splits in (1, 4):
        for window in (None, 16):
            attention_decode.decode_attention(q, kc, vc, table, rows, lens, 0.1, window, splits)
            attention_decode.decode_attention(
                q, kc, vc, table, rows, lens, 0.1, window, splits,
                rotary=attention_decode.DecodeRotary(k, v, i64(3), cos_sin, i64(3)))
            # a verify step's queries: one request, its three query tokens in the one program
            attention_decode.decode_attention(q, kc, vc, table, i64(1), lens[:1], 0.1, window, splits, queries=3)
        # a DLLM block's queries, which all see each other
        attention_decode.decode_attention(q, kc, vc, table, i64(1), lens[:1], 0.1, None, splits, queries=3,
                                          whole_row=True)
    i32 = lambda n: torch.zeros(n, dtype=torch.int32)  # noqa: E731
    for window in (None, 16):
        attention_extend.extend_attention(q, kc, vc, table, i64(1), i32(1), i32(1), torch.full((1,), 3, dtype=torch.int32),
                                          3, 0.1, window)


@triton.jit
def _reshaped_in_branch(x_ptr):
    """Runs in the interpreter; Triton's compiler refuses it (cols changes shape inside a runtime if)."""
    cols = tl.arange(0, 16)
    x = tl.load(x_ptr + cols)
    if tl.load(x_ptr) > 0:
        cols = tl.arange(0, 32)
        tl.store(x_ptr + cols, tl.zeros([32], dtype=tl.float32))
    tl.store(x_ptr + tl.arange(0, 16), x)


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run with TRITON_INTERPRET unset: the interpreter makes no JIT functions")
    with Recorder() as recorder:
        if "--self-check" in argv:
            _reshaped_in_branch[(1,)](torch.zeros(32))
        else:
            _calls()
    failed = 0
    for fn, args, kwargs in recorder.launches:
        try:
            compile_launch(fn, args, kwargs)
            print(f"ok {fn.__name__}")
        except Exception as err:  # noqa: BLE001 - every kernel is reported
            failed += 1
            print(f"FAIL {fn.__name__}: {type(err).__name__}: {str(err)[:2000]}")
    print(f"{len(recorder.launches) - failed} of {len(recorder.launches)} launches compiled for sm_90")
    return 1 if failed or not recorder.launches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
