"""The triton attention backend equals the torch reference and dense float64 attention: DECODE,
EXTEND with a cached prefix (longer than one query block), MIXED, page sizes 1 and 16, GQA,
sliding window, split-K decode, and CUDA-graph-style ``init_capture``/``init_replay`` with padding.

Without a GPU the kernels run in Triton's CPU interpreter (float32); the GPU variants use bfloat16.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from modeserve.engine import LLM, SamplingParams
from modeserve.engine.forward_mode import ForwardMode
from modeserve.kernels.attention.base import (
    AttentionInputs,
    GraphInputs,
    create_attention_backend,
    resolve_backend_name,
)
from modeserve.kernels.attention.kv_cache import KVCache
from modeserve.kernels.attention.triton_backend import TritonAttentionBackend
from modeserve.kernels import ops
from modeserve.kernels.triton.attention_decode import DecodeRotary, DecodeTiles, decode_attention

from tests.engine.tiny_models import COMMON, make_tiny_model, mixed_prompts, teacher_forced_logits
from tests.kernels.test_attention_backends import (
    HKV,
    HQ,
    D,
    dense_reference,
    make_case,
    run_backend,
)

KINDS = ["decode", "extend", "mixed"]
WINDOWS = [None, 6, 40]


def long_extend_case(page_size: int, device: str, dtype: torch.dtype) -> dict:
    """A MIXED case like ``make_case``'s whose extends pass one 64-row query block, over prefixes."""
    g = torch.Generator().manual_seed(4)
    prefix, ext = [30, 0, 7, 90], [100, 70, 1, 1]
    seq = [p + e for p, e in zip(prefix, ext)]
    num_pages = sum(math.ceil(s / page_size) for s in seq) + 2
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0 reserved
    req_to_token = torch.zeros(len(seq), 256, dtype=torch.int64)
    out_loc, used = [], 0
    for r, (p, s) in enumerate(zip(prefix, seq)):
        n = math.ceil(s / page_size)
        pages, used = perm[used : used + n], used + n
        req_to_token[r, :s] = torch.tensor([pages[i // page_size] * page_size + i % page_size for i in range(s)])
        out_loc.append(req_to_token[r, p:s])
    t, num_slots = sum(ext), num_pages * page_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    return {"prefix": prefix, "ext": ext, "seq": seq, "req_to_token": req_to_token.to(device),
            "out_loc": torch.cat(out_loc).to(device), "num_slots": num_slots, "k_hist": randn(num_slots, HKV, D),
            "v_hist": randn(num_slots, HKV, D), "q": randn(t, HQ, D), "k": randn(t, HKV, D), "v": randn(t, HKV, D)}


def make_cache(case: dict, page_size: int, device: str, dtype: torch.dtype) -> KVCache:
    cache = KVCache(1, case["num_slots"], HKV, D, page_size, dtype, torch.device(device))
    cache.k[0].copy_(case["k_hist"])
    cache.v[0].copy_(case["v_hist"])
    return cache


def decode_inputs(case: dict, rows: list[int], device: str, dtype: torch.dtype) -> AttentionInputs:
    """DECODE inputs for a subset of a decode case's requests (their pool rows stay the same)."""
    return AttentionInputs(
        forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor(rows, device=device),
        prefix_lens_cpu=[case["prefix"][r] for r in rows], extend_lens_cpu=[1] * len(rows),
        seq_lens=torch.tensor([case["seq"][r] for r in rows], device=device),
        out_cache_loc=case["out_loc"][rows], req_to_token=case["req_to_token"], dtype=dtype)


def static_rows(bs: int, table: torch.Tensor) -> GraphInputs:
    """A graph's static rows as the runner makes them: padding only (request row 0, one key, slot 0)."""
    device = table.device
    return GraphInputs(torch.zeros(bs, dtype=torch.int64, device=device), torch.zeros(bs, dtype=torch.int64,
                       device=device), torch.ones(bs, dtype=torch.int64, device=device), table)


def replay_inputs(case: dict, rows: list[int], static: GraphInputs, dtype: torch.dtype) -> AttentionInputs:
    """Write a decode case's ``rows`` into the static buffers (the rest padding), as the runner does
    before a replay; the inputs' device tensors are views of them."""
    n, real = len(rows), decode_inputs(case, rows, str(static.seq_lens.device), dtype)
    for buf, values, pad in ((static.out_cache_loc, real.out_cache_loc, 0),
                             (static.req_pool_indices, real.req_pool_indices, 0), (static.seq_lens, real.seq_lens, 1)):
        buf.fill_(pad)
        buf[:n] = values
    return AttentionInputs(
        forward_mode=ForwardMode.DECODE, req_pool_indices=static.req_pool_indices[:n],
        prefix_lens_cpu=real.prefix_lens_cpu, extend_lens_cpu=real.extend_lens_cpu, seq_lens=static.seq_lens[:n],
        out_cache_loc=static.out_cache_loc[:n], req_to_token=case["req_to_token"], dtype=dtype)


# ---- checks shared by the CPU (interpreter) and GPU tests ----


def check_backend(case: dict, page_size: int, device: str, dtype: torch.dtype, window: int | None,
                  tol: float) -> None:
    out = run_backend("triton", case, page_size, device, dtype, window)
    assert out.dtype == dtype and out.shape == case["q"].shape
    ref = run_backend("torch", case, page_size, device, dtype, window)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert (out.double() - dense_reference(case, window)).abs().max() < 1.5 * tol


def check_graph_replay(page_size: int, device: str, dtype: torch.dtype, window: int | None, tol: float) -> None:
    """Capture-style forward padding rows only, then replays of 5 and 3 real rows padded to 8:
    the real rows match dense attention and read only the static buffers."""
    case = make_case("decode", page_size, device, dtype)
    cache = make_cache(case, page_size, device, dtype)
    backend = create_attention_backend("triton", torch.device(device), dtype, kv_cache=cache, num_heads=HQ,
                                       scale=1 / math.sqrt(D), sliding_window=window)
    bs = 8
    static = static_rows(bs, case["req_to_token"])
    static_q = torch.zeros(bs, HQ, D, dtype=dtype, device=device)
    static_k = torch.zeros(bs, HKV, D, dtype=dtype, device=device)
    static_v = torch.zeros_like(static_k)
    backend.init_capture(bs, static)
    assert torch.isfinite(backend.forward(static_q, static_k, static_v, 0)).all()  # warm-up: padding rows
    dense = dense_reference(case, window)
    for rows in ([0, 1, 2, 3, 4], [3, 1, 4]):
        n = len(rows)
        inputs = replay_inputs(case, rows, static, dtype)
        for buf, real in ((static_q, case["q"]), (static_k, case["k"]), (static_v, case["v"])):
            buf.zero_()
            buf[:n] = real[rows]
        backend.init_replay(inputs, bs)
        backend.init_forward_metadata(decode_inputs(case, [0], device, dtype))  # another step between
        backend.init_replay(inputs, bs)
        with pytest.raises(ValueError, match="slot table it was captured with"):
            backend.init_replay(AttentionInputs(**{**inputs.__dict__, "req_to_token": inputs.req_to_token.clone()}),
                                bs)
        out = backend.forward(static_q, static_k, static_v, 0)
        assert torch.isfinite(out).all()
        assert (out[:n].double() - dense[rows]).abs().max() < tol


def check_decode_splits(num_kv_splits: int | None, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None,
                        device: str, dtype: torch.dtype, tol: float, tiles: DecodeTiles | None = None) -> None:
    """The decode kernel alone, against dense attention, for a split count, head shapes and launch shape."""
    g = torch.Generator().manual_seed((num_kv_splits or 0) + head_dim)
    seq = [1, 2, 37, 150, 64]
    num_slots = sum(seq) + 1
    slots = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    req_to_token = torch.zeros(len(seq) + 1, 160, dtype=torch.int64)
    used = 0
    for r, s in enumerate(seq):  # request r in pool row r + 1
        req_to_token[r + 1, :s] = torch.tensor(slots[used : used + s])
        used += s
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    qkv = torch.randn(len(seq), num_heads + 8, head_dim, generator=g)
    q = qkv[:, 4 : 4 + num_heads]  # a strided view, as from a fused projection
    scale = 1 / math.sqrt(head_dim)
    table = req_to_token.to(device)
    counters = torch.zeros(len(seq) * num_kv_heads + 3, dtype=torch.int32, device=device)
    outs = [decode_attention(
        q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
        table, torch.arange(1, len(seq) + 1, device=device).to(torch.int32),
        torch.tensor(seq, device=device), scale, window, num_kv_splits, counters, tiles=tiles) for _ in range(2)]
    assert (counters == 0).all()  # the last slice of each (request, kv head) reset its counter
    assert torch.equal(outs[0], outs[1])  # a reused counter buffer merges again, in the same order
    out = outs[0]
    group = num_heads // num_kv_heads
    for r, s in enumerate(seq):
        idx = req_to_token[r + 1, :s]
        lo = max(0, s - window) if window else 0
        kk = k_cache[idx][lo:].double().repeat_interleave(group, dim=1)  # [S, Hq, D]
        vv = v_cache[idx][lo:].double().repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,shd->hs", q[r].double(), kk) * scale).softmax(-1)
        ref = torch.einsum("hs,shd->hd", p, vv)
        assert (out[r].cpu().double() - ref).abs().max() < tol, (r, s)


def check_decode_rotary(num_kv_splits: int | None, num_heads: int, num_kv_heads: int, head_dim: int,
                        window: int | None, device: str, dtype: torch.dtype, tol: float,
                        tiles: DecodeTiles | None = None) -> None:
    """The decode kernel given the step's unrotated q/k/v (``DecodeRotary``) equals rotary + KV store
    (``ops.apply_rotary_and_store_kv``, the reference) followed by the plain kernel: the same output
    and the same cache afterwards, bit for bit."""
    g = torch.Generator().manual_seed(head_dim + num_heads)
    seq = [1, 2, 37, 150, 64]
    num_slots = sum(seq) + 1
    slots = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    req_to_token = torch.zeros(len(seq) + 1, 160, dtype=torch.int64)
    used = 0
    for r, s in enumerate(seq):
        req_to_token[r + 1, :s] = torch.tensor(slots[used : used + s])
        used += s
    table = req_to_token.to(device)
    rows = torch.arange(1, len(seq) + 1, device=device)
    seq_lens = torch.tensor(seq, device=device)
    loc = torch.stack([req_to_token[r + 1, s - 1] for r, s in enumerate(seq)]).to(device)  # the step's slots
    positions = seq_lens - 1
    cos_sin = ops.rope_cos_sin(ops.rope_inv_freq(head_dim, 10000.0), 256).to(device)
    qkv = torch.randn(len(seq), num_heads + 2 * num_kv_heads + 3, head_dim, generator=g).to(device, dtype)
    q = qkv[:, 1 : 1 + num_heads]  # strided views, as from the fused projection
    k = qkv[:, 1 + num_heads : 1 + num_heads + num_kv_heads]
    v = qkv[:, 1 + num_heads + num_kv_heads : 1 + num_heads + 2 * num_kv_heads]
    caches = [torch.randn(num_slots, num_kv_heads, head_dim, generator=g).to(device, dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    q_rot, _ = ops.apply_rotary_and_store_kv(q, k, v, positions, cos_sin, *ref_caches, loc)
    scale = 1 / math.sqrt(head_dim)
    ref = decode_attention(q_rot, *ref_caches, table, rows, seq_lens, scale, window, num_kv_splits)
    out = decode_attention(q, *caches, table, rows, seq_lens, scale, window, num_kv_splits,
                           rotary=DecodeRotary(k, v, positions, cos_sin, loc), tiles=tiles)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    assert (out.double() - ref.double()).abs().max() < tol


# ---- CPU: Triton's interpreter ----


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_triton_equals_torch_reference(kind: str, page_size: int, window: int | None) -> None:
    check_backend(make_case(kind, page_size, "cpu", torch.float32), page_size, "cpu", torch.float32, window, 1e-4)


@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_long_extend_over_prefix(page_size: int, window: int | None) -> None:
    case = long_extend_case(page_size, "cpu", torch.float32)
    check_backend(case, page_size, "cpu", torch.float32, window, 1e-4)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_graph_capture_and_replay_with_padding(page_size: int, window: int | None) -> None:
    check_graph_replay(page_size, "cpu", torch.float32, window, 1e-4)


@pytest.mark.parametrize(("num_kv_splits", "num_heads", "num_kv_heads", "head_dim", "window"), [
    (1, 8, 2, 64, None), (3, 8, 2, 64, None), (8, 8, 2, 64, 20), (4, 4, 4, 32, None), (5, 6, 2, 80, 100),
    (32, 8, 2, 64, None),  # empty slices (1- and 2-key requests)
])
def test_triton_decode_kernel_splits_and_heads(num_kv_splits: int, num_heads: int, num_kv_heads: int,
                                               head_dim: int, window: int | None) -> None:
    check_decode_splits(num_kv_splits, num_heads, num_kv_heads, head_dim, window, "cpu", torch.float32, 1e-4)


@pytest.mark.parametrize(("num_kv_splits", "num_heads", "num_kv_heads", "head_dim", "window"), [
    (1, 8, 2, 64, None), (3, 8, 2, 64, 20), (32, 8, 2, 64, None), (4, 6, 2, 80, 100), (5, 4, 4, 32, None),
])
def test_decode_with_rotary_equals_rotary_then_decode(num_kv_splits: int, num_heads: int, num_kv_heads: int,
                                                      head_dim: int, window: int | None) -> None:
    check_decode_rotary(num_kv_splits, num_heads, num_kv_heads, head_dim, window, "cpu", torch.float32, 1e-5)


@pytest.mark.parametrize(("tiles", "num_kv_splits", "window"), [
    (DecodeTiles(16, 2, 1), 3, None), (DecodeTiles(64, 8, 2), 1, 20), (DecodeTiles(128, None, 4), 2, None),
])
def test_decode_kernel_launch_shapes(tiles: DecodeTiles, num_kv_splits: int, window: int | None) -> None:
    """Other keys-per-step blocks (one block per request up to many) give the same attention."""
    check_decode_splits(num_kv_splits, 8, 2, 64, window, "cpu", torch.float32, 1e-4, tiles)
    check_decode_rotary(num_kv_splits, 8, 2, 64, window, "cpu", torch.float32, 1e-5, tiles)


def test_decode_tiles_must_be_valid() -> None:
    q = torch.zeros(2, 4, 16)
    cache = torch.zeros(3, 2, 16)
    table = torch.zeros(2, 4, dtype=torch.int64)
    rows, lens = torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    for bad, field in (((24,), "block_n"), ((512,), "block_n"), ((8,), "block_n"),
                       ((32, 3), "num_warps"), ((32, 4, 0), "num_stages")):
        with pytest.raises(ValueError, match=field):
            decode_attention(q, cache, cache, table, rows, lens, 0.25, None, 2, tiles=DecodeTiles(*bad))
    with pytest.raises(ValueError, match="num_warps"):
        TritonAttentionBackend(KVCache(1, 16, 2, 16, 1, torch.float32, torch.device("cpu")), 4, 0.25, None,
                               decode_tiles=DecodeTiles(32, 5))


def test_decode_launch_carries_the_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """What reaches the kernel launch: the given block, warps and stages, or the defaults: with several
    splits 32-key blocks, 4 warps up to head_dim 128 and Triton's own stage count (none passed); with
    one split up to head_dim 128, 64-key blocks, 4 warps and 3 stages."""
    import modeserve.kernels.triton.attention_decode as mod

    launches: list[dict] = []

    class Spy:
        def __getitem__(self, grid: tuple) -> object:
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(mod, "_decode_split_kernel", Spy())
    q, cache = torch.zeros(2, 4, 16), torch.zeros(3, 2, 16)
    table, rows, lens = torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.ones(2)
    decode_attention(q, cache, cache, table, rows, lens, 0.25, None, 2, tiles=DecodeTiles(64, 8, 2))
    decode_attention(q, cache, cache, table, rows, lens, 0.25, None, 2)
    assert (launches[0]["BLOCK_N"], launches[0]["num_warps"], launches[0]["num_stages"]) == (64, 8, 2)
    decode_attention(q, cache, cache, table, rows, lens, 0.25, None, 1)
    wide_q, wide_cache = torch.zeros(2, 4, 256), torch.zeros(3, 2, 256)
    decode_attention(wide_q, wide_cache, wide_cache, table, rows, lens, 0.25, None, 1)
    assert (launches[1]["BLOCK_N"], launches[1]["num_warps"], "num_stages" in launches[1]) == (32, 4, False)
    assert (launches[2]["BLOCK_N"], launches[2]["num_warps"], launches[2]["num_stages"]) == (64, 4, 3)
    assert (launches[3]["BLOCK_N"], launches[3]["num_warps"], "num_stages" in launches[3]) == (32, 8, False)


def test_decode_counters_must_fit() -> None:
    q = torch.zeros(2, 4, 16)
    cache = torch.zeros(3, 2, 16)
    table = torch.zeros(2, 4, dtype=torch.int64)
    rows, lens = torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    for bad in (torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)):  # needs 2 rows x 2 kv heads
        with pytest.raises(ValueError, match="counters must be int32 with at least 4"):
            decode_attention(q, cache, cache, table, rows, lens, 0.25, None, 2, bad)


def test_resolve_triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend_name("triton", cpu) == "triton"
    assert resolve_backend_name("auto", cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton needs a CUDA device"):
        resolve_backend_name("triton", cpu)
    assert resolve_backend_name("triton", cuda, torch.float32) == "triton"
    importable = {"flashinfer": False, "triton": True}
    monkeypatch.setattr("modeserve.kernels.attention.base._importable", lambda m: importable[m])
    assert resolve_backend_name("auto", cuda, torch.bfloat16, 128) == "triton"
    importable["flashinfer"] = True
    assert resolve_backend_name("auto", cuda, torch.bfloat16, 128) == "flashinfer-triton"
    assert resolve_backend_name("auto", cuda, torch.float32, 128) == "triton"
    assert resolve_backend_name("auto", cuda, torch.bfloat16, 96) == "triton"
    with pytest.raises(ValueError, match="flashinfer-triton needs a CUDA device"):
        resolve_backend_name("flashinfer-triton", cuda, torch.float32, 128)
    importable["triton"] = False
    assert resolve_backend_name("auto", cuda, torch.bfloat16, 128) == "flashinfer"
    assert resolve_backend_name("auto", cuda, torch.float32, 128) == "torch"


# ---- GPU: compiled kernels, bfloat16 ----


@pytest.mark.gpu
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_triton_equals_torch_reference_gpu(kind: str, page_size: int, window: int | None) -> None:
    check_backend(make_case(kind, page_size, "cuda", torch.bfloat16), page_size, "cuda", torch.bfloat16, window, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_long_extend_over_prefix_gpu(page_size: int, window: int | None) -> None:
    case = long_extend_case(page_size, "cuda", torch.bfloat16)
    check_backend(case, page_size, "cuda", torch.bfloat16, window, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_kv_splits", "num_heads", "num_kv_heads", "head_dim", "window"), [
    (None, 32, 8, 128, None), (1, 8, 2, 64, None), (8, 8, 2, 64, 20), (4, 16, 16, 256, None),
    (5, 6, 2, 80, 100), (16, 32, 4, 128, None), (32, 32, 8, 64, None),
])
def test_triton_decode_kernel_splits_and_heads_gpu(num_kv_splits: int | None, num_heads: int, num_kv_heads: int,
                                                   head_dim: int, window: int | None) -> None:
    check_decode_splits(num_kv_splits, num_heads, num_kv_heads, head_dim, window, "cuda", torch.bfloat16, 3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [DecodeTiles(16, 4, 2), DecodeTiles(32, 4, 1), DecodeTiles(32, 8, 4),
                                   DecodeTiles(64, 4, 2), DecodeTiles(64, 4, 3), DecodeTiles(64, 8, 3),
                                   DecodeTiles(128, 8, 2)])
def test_decode_kernel_launch_shapes_gpu(tiles: DecodeTiles) -> None:
    """The launch shapes ``bench attention`` compares compile for sm_90 and give the same attention."""
    check_decode_splits(1, 32, 8, 128, None, "cuda", torch.bfloat16, 3e-2, tiles)
    check_decode_splits(4, 32, 8, 128, 20, "cuda", torch.bfloat16, 3e-2, tiles)
    check_decode_rotary(1, 32, 8, 128, None, "cuda", torch.bfloat16, 2e-2, tiles)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_kv_splits", "num_heads", "num_kv_heads", "head_dim", "window"), [
    (None, 32, 8, 128, None), (None, 32, 8, 64, None), (32, 32, 8, 64, None), (8, 8, 2, 64, 20), (5, 6, 2, 80, 100),
])
def test_decode_with_rotary_equals_rotary_then_decode_gpu(num_kv_splits: int | None, num_heads: int,
                                                          num_kv_heads: int, head_dim: int, window: int | None) -> None:
    check_decode_rotary(num_kv_splits, num_heads, num_kv_heads, head_dim, window, "cuda", torch.bfloat16, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_graph_hooks_gpu(page_size: int, window: int | None) -> None:
    check_graph_replay(page_size, "cuda", torch.bfloat16, window, 3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_cuda_graph_replay_gpu(page_size: int, window: int | None) -> None:
    """A really captured graph: replays of different rows and lengths match dense attention."""
    dtype, device, bs = torch.bfloat16, "cuda", 8
    case = make_case("decode", page_size, device, dtype)
    backend = create_attention_backend("triton", torch.device(device), dtype,
                                       kv_cache=make_cache(case, page_size, device, dtype), num_heads=HQ,
                                       scale=1 / math.sqrt(D), sliding_window=window)
    static = static_rows(bs, case["req_to_token"])
    static_q = torch.zeros(bs, HQ, D, dtype=dtype, device=device)
    static_k = torch.zeros(bs, HKV, D, dtype=dtype, device=device)
    static_v = torch.zeros_like(static_k)
    backend.init_capture(bs, static)
    for _ in range(2):  # warm-up (compilation) outside the graph, as the runner does
        backend.forward(static_q, static_k, static_v, 0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(static_q, static_k, static_v, 0)
    dense = dense_reference(case, window)
    for rows in ([0, 1, 2, 3, 4], [4, 0], [2]):
        n = len(rows)
        inputs = replay_inputs(case, rows, static, dtype)
        for buf, real in ((static_q, case["q"]), (static_k, case["k"]), (static_v, case["v"])):
            buf.zero_()
            buf[:n] = real[rows]
        backend.init_replay(inputs, bs)
        graph.replay()
        assert torch.isfinite(static_out).all()
        assert (static_out[:n].double() - dense[rows]).abs().max() < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_triton_step_has_no_host_sync_gpu(kind: str) -> None:
    """A step's metadata and forward never wait for the device (once the kernels are compiled)."""
    dtype, device = torch.bfloat16, "cuda"
    case = make_case(kind, 16, device, dtype)
    backend = create_attention_backend("triton", torch.device(device), dtype,
                                       kv_cache=make_cache(case, 16, device, dtype), num_heads=HQ,
                                       scale=1 / math.sqrt(D), sliding_window=6)
    ext = case["ext"]
    inputs = AttentionInputs(
        forward_mode=ForwardMode.DECODE if all(e == 1 for e in ext) else ForwardMode.MIXED,
        req_pool_indices=torch.arange(len(ext), device=device), prefix_lens_cpu=case["prefix"], extend_lens_cpu=ext,
        seq_lens=torch.tensor(case["seq"], device=device), out_cache_loc=case["out_loc"],
        req_to_token=case["req_to_token"], dtype=dtype)
    for check_syncs in (False, True):  # the first step compiles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if check_syncs else "default")
        try:
            backend.init_forward_metadata(inputs)
            out = backend.forward(case["q"], case["k"], case["v"], 0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert (out.double() - dense_reference(case, 6)).abs().max() < 3e-2


def check_engine_against_torch_backend(arch: str, page_size: int, device: str, dtype: torch.dtype,
                                       tmp_path: Path) -> dict[str, dict[str, int]]:
    """Teacher-forced engine steps in every mode: the triton backend's logits (with CUDA graphs
    where the device has them) equal the torch backend's; returns the graph runner's stats."""
    folder = make_tiny_model(arch, tmp_path / arch, head_dim=64)
    prompts = mixed_prompts(11, COMMON["vocab_size"], seed=12, shared_prefix=16)  # 11 rows: padded to 12
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    kw = {"device": device, "dtype": str(dtype).removeprefix("torch."), "page_size": page_size,
          "chunked_prefill_size": 16, "enable_mixed": True, "max_prefill_ratio": 0.9, "cuda_graph_max_bs": 16}
    tri, ref = LLM(model=str(folder), attention_backend="triton", **kw), LLM(model=str(folder),
                                                                             attention_backend="torch", **kw)
    for llm in (tri, ref):
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=greedy)  # warm the prefix cache
        for p in prompts:
            llm.add_request(llm.make_request(p, greedy))
    assert {"MIXED", "DECODE"} <= teacher_forced_logits(tri, ref, rtol=5e-2)
    return tri.runner.graphs.stats() if tri.runner.graphs is not None else {}


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama3", "mistral-window"])
def test_triton_engine_with_cuda_graphs_equals_torch_backend_gpu(tmp_path: Path, arch: str, page_size: int) -> None:
    stats = check_engine_against_torch_backend(arch, page_size, "cuda", torch.bfloat16, tmp_path)
    assert stats["hits"]["DECODE"] > 0  # padding: test_triton_cuda_graph_replay_gpu and test_gpu_engine
