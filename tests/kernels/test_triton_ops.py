"""The Triton elementwise ops equal the torch references in ``kernels.ops`` (and ``KVCache.write``).

Rotary embedding and KV stores must match bit for bit in every dtype; the norms and SiLU-and-mul
within a tolerance (summation order; SiLU-and-mul rounds once where the reference rounds twice).
Without a GPU the kernels run in Triton's CPU interpreter, in float32 and float16 (numpy reproduces
its rounding; the residual sum must then match exactly too). The interpreter rounds bfloat16 by
truncation, so bfloat16 is checked only on a GPU.
"""
from __future__ import annotations

import inspect

import pytest
import torch
from modeserve.kernels import ops
from modeserve.kernels.attention.kv_cache import KVCache
from modeserve.kernels.triton import ops as triton_ops
from modeserve.kernels.triton.rotary import store_kv

# (rtol, atol) for the norms and SiLU-and-mul: a rounding or two apart in 16-bit dtypes
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
CPU_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def randn(*shape: int, dtype: torch.dtype, device: str, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol, atol = TOL[ref.dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def fused_qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """q [T, Hq, D], k, v [T, Hkv, D]: non-contiguous views of one [T, (Hq + 2 Hkv) D] tensor."""
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype, device=device, seed=t + d)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def padded_heads(x: torch.Tensor) -> torch.Tensor:
    """x's values in a view whose head stride is not D (each head followed by 16 unused elements)."""
    return torch.nn.functional.pad(x, (0, 16))[..., : x.shape[-1]]


# ---- checks shared by the CPU (interpreter) and GPU tests ----


def check_rms_norm(t: int, hidden: int, eps: float, scale: float, dtype: torch.dtype, device: str) -> None:
    x = randn(t, hidden, dtype=dtype, device=device, scale=scale)
    weight = randn(hidden, dtype=dtype, device=device, seed=1) + 1
    x_before = x.clone()
    assert_close(triton_ops.rms_norm(x, weight, eps), ops.rms_norm(x, weight, eps))
    assert torch.equal(x, x_before)


def check_add_rms_norm(t: int, hidden: int, eps: float, scale: float, dtype: torch.dtype, device: str) -> None:
    x = randn(t, hidden, dtype=dtype, device=device, scale=scale)
    residual = randn(t, hidden, dtype=dtype, device=device, seed=2, scale=scale)
    weight = randn(hidden, dtype=dtype, device=device, seed=1) + 1
    inputs = (x.clone(), residual.clone())
    out, new_residual = triton_ops.add_rms_norm(x, residual, weight, eps)
    ref_out, ref_residual = ops.add_rms_norm(x, residual, weight, eps)
    assert_close(out, ref_out)
    assert new_residual.dtype == ref_residual.dtype
    if device == "cpu":  # one rounded add, reproduced exactly by the interpreter (float32/float16)
        assert torch.equal(new_residual, ref_residual)
        # the rounded sum is what gets normalised
        assert torch.equal(out, triton_ops.rms_norm(new_residual, weight, eps))
    assert_close(new_residual, ref_residual)
    assert torch.equal(x, inputs[0]) and torch.equal(residual, inputs[1])


def check_qk_norm(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str) -> None:
    """Per-head RMSNorm (Qwen3 q/k norm) on strided views of a fused qkv tensor."""
    q, k, _ = fused_qkv(t, hq, hkv, d, dtype, device)
    weight = randn(d, dtype=dtype, device=device, seed=3) + 1
    assert t == 1 or not (q.is_contiguous() or k.is_contiguous())
    assert_close(triton_ops.rms_norm(q, weight, 1e-6), ops.rms_norm(q, weight, 1e-6))
    assert_close(triton_ops.rms_norm(k, weight, 1e-6), ops.rms_norm(k, weight, 1e-6))
    k = padded_heads(k)
    assert_close(triton_ops.rms_norm(k, weight, 1e-6), ops.rms_norm(k, weight, 1e-6))


def check_silu_and_mul(t: int, inter: int, dtype: torch.dtype, device: str) -> None:
    x = randn(t, 2 * inter, dtype=dtype, device=device, scale=3.0)
    assert_close(triton_ops.silu_and_mul(x), ops.silu_and_mul(x))
    wide = randn(t, 2 * inter + 40, dtype=dtype, device=device, seed=4)[:, 8 : 8 + 2 * inter]  # row stride
    assert_close(triton_ops.silu_and_mul(wide), ops.silu_and_mul(wide))


def check_rotary(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str) -> None:
    """Bit-exact: the kernel rounds each product and sum to q's dtype, as the reference's ops do."""
    max_pos = 300
    cos_sin = ops.rope_cos_sin(ops.rope_inv_freq(d, 10000.0), max_pos).to(device)
    g = torch.Generator().manual_seed(t)
    positions = torch.randint(0, max_pos, (t,), generator=g).to(device)  # out of order, repeats
    q, k, _ = fused_qkv(t, hq, hkv, d, dtype, device)
    layouts = [(q, k), (q.contiguous(), k.contiguous()), (q, padded_heads(k))]
    for qq, kk in layouts if t <= 8 else layouts[:1]:  # other layouts on small T only (interpreter time)
        q_out, k_out = triton_ops.apply_rotary(qq, kk, positions, cos_sin)
        q_ref, k_ref = ops.apply_rotary(qq, kk, positions, cos_sin)
        assert q_out.dtype == q_ref.dtype and k_out.dtype == k_ref.dtype
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def check_store_kv(t: int, hkv: int, d: int, dtype: torch.dtype, cache_dtype: torch.dtype, device: str) -> None:
    _, k, v = fused_qkv(t, 2 * hkv, hkv, d, dtype, device)
    num_slots = 4 * t + 8
    g = torch.Generator().manual_seed(t)
    loc = torch.randperm(num_slots, generator=g)[:t].to(device)  # distinct slots, out of order
    ref = KVCache(1, num_slots, hkv, d, page_size=1, dtype=cache_dtype, device=torch.device(device))
    out = KVCache(1, num_slots, hkv, d, page_size=1, dtype=cache_dtype, device=torch.device(device))
    layouts = [(k, v), (padded_heads(k), v), (k, padded_heads(v))]
    for kk, vv in layouts if t <= 8 else layouts[:1]:
        ref.write(0, loc, kk, vv)
        store_kv(out.k[0], out.v[0], loc, kk, vv)
        assert torch.equal(out.k[0], ref.k[0]) and torch.equal(out.v[0], ref.v[0])
        loc = loc.roll(1)  # the next pair lands on other slots


def check_rotary_and_store_kv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, cache_dtype: torch.dtype,
                              device: str) -> None:
    """The fused kernel's (q, k) and cache contents equal the references run one after the other, bit for bit."""
    max_pos = 300
    cos_sin = ops.rope_cos_sin(ops.rope_inv_freq(d, 10000.0), max_pos).to(device)
    g = torch.Generator().manual_seed(t + 1)
    positions = torch.randint(0, max_pos, (t,), generator=g).to(device)
    num_slots = 4 * t + 8
    loc = torch.randperm(num_slots, generator=g)[:t].to(device)
    q, k, v = fused_qkv(t, hq, hkv, d, dtype, device)
    ref = KVCache(1, num_slots, hkv, d, page_size=1, dtype=cache_dtype, device=torch.device(device))
    out = KVCache(1, num_slots, hkv, d, page_size=1, dtype=cache_dtype, device=torch.device(device))
    layouts = [(k, v), (padded_heads(k), padded_heads(v))]
    for kk, vv in layouts if t <= 8 else layouts[:1]:
        q_ref, k_ref = ops.apply_rotary_and_store_kv(q, kk, vv, positions, cos_sin, ref.k[0], ref.v[0], loc)
        q_out, k_out = triton_ops.apply_rotary_and_store_kv(q, kk, vv, positions, cos_sin, out.k[0], out.v[0], loc)
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
        assert torch.equal(out.k[0], ref.k[0]) and torch.equal(out.v[0], ref.v[0])
        assert out.k[0][loc].abs().sum() > 0  # the rotated keys did land
        loc = loc.roll(1)


# ---- CPU: Triton's interpreter ----

SHAPES = [(t, h) for t in (1, 7, 64) for h in (64, 96, 576)]
EPS_SCALE = [(1e-6, 1.0), (1e-5, 1e-3), (0.5, 1.0)]  # the last two: eps dominates mean(x^2)
HEADS = [(4, 2, 64), (9, 3, 64), (3, 1, 96), (2, 2, 128)]  # (Hq, Hkv, D); 9/3/64 is SmolLM2-135M


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("eps,scale", EPS_SCALE)
@pytest.mark.parametrize("t,hidden", SHAPES)
def test_rms_norm(t: int, hidden: int, eps: float, scale: float, dtype: torch.dtype) -> None:
    check_rms_norm(t, hidden, eps, scale, dtype, "cpu")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("eps,scale", EPS_SCALE)
@pytest.mark.parametrize("t,hidden", SHAPES)
def test_add_rms_norm(t: int, hidden: int, eps: float, scale: float, dtype: torch.dtype) -> None:
    check_add_rms_norm(t, hidden, eps, scale, dtype, "cpu")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("t", [1, 7])
def test_rms_norm_on_qk_views(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    check_qk_norm(t, hq, hkv, d, dtype, "cpu")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("inter", [64, 96, 1536, 2100])
@pytest.mark.parametrize("t", [1, 7, 64])
def test_silu_and_mul(t: int, inter: int, dtype: torch.dtype) -> None:
    check_silu_and_mul(t, inter, dtype, "cpu")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("t", [1, 7, 64])
def test_apply_rotary(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    check_rotary(t, hq, hkv, d, dtype, "cpu")


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                               (torch.float16, torch.float16)], ids=str)
@pytest.mark.parametrize("hkv,d", [(1, 64), (3, 64), (2, 96)])
@pytest.mark.parametrize("t", [1, 7, 64])
def test_store_kv(t: int, hkv: int, d: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    check_store_kv(t, hkv, d, dtype, cache_dtype, "cpu")


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                               (torch.float32, torch.float16)], ids=str)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("t", [1, 7])
def test_apply_rotary_and_store_kv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype,
                                   cache_dtype: torch.dtype) -> None:
    check_rotary_and_store_kv(t, hq, hkv, d, dtype, cache_dtype, "cpu")


def test_leading_dims_and_empty_inputs() -> None:
    x = randn(2, 3, 5, 64, dtype=torch.float32, device="cpu")
    weight = randn(64, dtype=torch.float32, device="cpu", seed=1)
    assert_close(triton_ops.rms_norm(x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6))
    assert_close(triton_ops.silu_and_mul(x), ops.silu_and_mul(x))
    empty = torch.empty(0, 64)
    assert triton_ops.rms_norm(empty, weight, 1e-6).shape == (0, 64)
    assert [o.shape for o in triton_ops.add_rms_norm(empty, empty, weight, 1e-6)] == [(0, 64), (0, 64)]
    assert triton_ops.silu_and_mul(empty).shape == (0, 32)
    q, k = triton_ops.apply_rotary(torch.empty(0, 4, 64), torch.empty(0, 2, 64), torch.empty(0, dtype=torch.int64),
                                   ops.rope_cos_sin(ops.rope_inv_freq(64, 10000.0), 8))
    assert q.shape == (0, 4, 64) and k.shape == (0, 2, 64)


def test_mixed_dtypes_promote_like_the_reference() -> None:
    """A float32 weight (or residual) on float16 activations gives float32 outputs, as ``weight * x`` does."""
    x = randn(7, 96, dtype=torch.float16, device="cpu")
    residual = randn(7, 96, dtype=torch.float32, device="cpu", seed=2)
    weight = randn(96, dtype=torch.float32, device="cpu", seed=1)
    assert_close(triton_ops.rms_norm(x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6))
    for out, ref in zip(triton_ops.add_rms_norm(x, residual, weight.half(), 1e-6),
                        ops.add_rms_norm(x, residual, weight.half(), 1e-6)):
        assert_close(out, ref)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="even"):
        triton_ops.silu_and_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="differ in shape"):
        triton_ops.add_rms_norm(torch.randn(3, 8), torch.randn(2, 8), torch.ones(8), 1e-6)
    cos_sin = ops.rope_cos_sin(ops.rope_inv_freq(64, 10000.0), 8)
    with pytest.raises(ValueError, match="match cos_sin"):
        triton_ops.apply_rotary(torch.randn(2, 4, 32), torch.randn(2, 2, 32), torch.zeros(2, dtype=torch.int64), cos_sin)
    cache = torch.zeros(16, 2, 64)
    with pytest.raises(ValueError, match="do not fit"):
        store_kv(cache, cache.clone(), torch.arange(3), torch.randn(3, 1, 64), torch.randn(3, 1, 64))


def test_same_signatures_as_the_torch_references() -> None:
    for name in triton_ops.__all__:
        assert inspect.signature(getattr(triton_ops, name)) == inspect.signature(getattr(ops, name)), name


# ---- GPU: bfloat16 / float16 / float32 with compiled kernels ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("eps,scale", EPS_SCALE)
@pytest.mark.parametrize("t,hidden", SHAPES + [(300, 4096), (5, 8192)])
def test_norms_gpu(t: int, hidden: int, eps: float, scale: float, dtype: torch.dtype) -> None:
    check_rms_norm(t, hidden, eps, scale, dtype, "cuda")
    check_add_rms_norm(t, hidden, eps, scale, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", HEADS + [(32, 8, 128)])
@pytest.mark.parametrize("t", [1, 7, 64, 1000])
def test_qk_norm_and_rotary_gpu(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    check_qk_norm(t, hq, hkv, d, dtype, "cuda")
    check_rotary(t, hq, hkv, d, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("inter", [64, 96, 1536, 14336])
@pytest.mark.parametrize("t", [1, 7, 64, 512])
def test_silu_and_mul_gpu(t: int, inter: int, dtype: torch.dtype) -> None:
    check_silu_and_mul(t, inter, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("hkv,d", [(1, 64), (3, 64), (8, 128)])
@pytest.mark.parametrize("t", [1, 7, 1000])
def test_store_kv_gpu(t: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    check_store_kv(t, hkv, d, dtype, dtype, "cuda")
    check_store_kv(t, hkv, d, torch.float32, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (32, 8, 128), (32, 8, 64)])
@pytest.mark.parametrize("t", [1, 7, 1000])
def test_apply_rotary_and_store_kv_gpu(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    check_rotary_and_store_kv(t, hq, hkv, d, dtype, dtype, "cuda")
