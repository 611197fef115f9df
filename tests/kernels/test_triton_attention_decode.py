"""The triton split-K decode kernel (``decode_attention``) on its own, against dense float64
attention: split counts (including empty slices), head shapes (GQA), sliding window and launch
shapes (``DecodeTiles``); with the step's unrotated q/k/v (``DecodeRotary``) it equals rotary + KV
store followed by the plain kernel, bit for bit in the cache; invalid tiles and too-small counter
buffers are refused, and the launch gets the given or default block, warps and stages. The
attention backend over it is in ``test_triton_attention``.

Without a GPU the kernel runs in Triton's CPU interpreter (float32); the GPU variants use bfloat16.
"""

from __future__ import annotations

import math

import pytest
import torch
from modeserve.kernels.attention.kv_cache import KVCache
from modeserve.kernels.attention.triton_backend import TritonAttentionBackend
from modeserve.kernels import ops
from modeserve.kernels.triton.attention_decode import DecodeRotary, DecodeTiles, decode_attention


# ---- checks shared by the CPU (interpreter) and GPU tests ----


def slot_table(seq: list[int], first_row: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """A slot table whose request r (pool row ``first_row + r``) holds ``seq[r]`` random distinct slots
    (slot 0 reserved); and the number of slots."""
    num_slots = sum(seq) + 1
    slots = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    req_to_token = torch.zeros(len(seq) + first_row, 160, dtype=torch.int64)
    used = 0
    for r, s in enumerate(seq):
        req_to_token[r + first_row, :s] = torch.tensor(slots[used : used + s])
        used += s
    return req_to_token, num_slots


def check_decode_splits(num_kv_splits: int | None, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None,
                        device: str, dtype: torch.dtype, tol: float, tiles: DecodeTiles | None = None) -> None:
    """The decode kernel alone, against dense attention, for a split count, head shapes and launch shape."""
    g = torch.Generator().manual_seed((num_kv_splits or 0) + head_dim)
    seq = [1, 2, 37, 150, 64]
    req_to_token, num_slots = slot_table(seq, 1, g)  # request r in pool row r + 1
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
    req_to_token, num_slots = slot_table(seq, 1, g)
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


def check_verify_queries(queries: int, num_kv_splits: int | None, num_heads: int, num_kv_heads: int, head_dim: int,
                         window: int | None, device: str, dtype: torch.dtype, tol: float,
                         whole_row: bool = False, reference_whole_row: bool | None = None) -> None:
    """Several query tokens a request (a verify step's last token and drafts, ``queries``): each row
    against dense causal attention over its request's keys up to its own position; ``whole_row`` (a
    DLLM block): over all of its request's keys."""
    g = torch.Generator().manual_seed(queries * 7 + head_dim + (num_kv_splits or 0))
    seq = [queries, queries + 1, 40, 150, 67]  # sequence lengths with this step's tokens
    req_to_token, num_slots = slot_table(seq, 2, g)  # request r in pool row r + 2
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    q = torch.randn(len(seq) * queries, num_heads, head_dim, generator=g)
    scale = 1 / math.sqrt(head_dim)
    out = decode_attention(q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
                           req_to_token.to(device), torch.arange(2, len(seq) + 2, device=device),
                           torch.tensor(seq, device=device), scale, window, num_kv_splits, queries=queries,
                           whole_row=whole_row).cpu()
    group = num_heads // num_kv_heads
    for r, s in enumerate(seq):
        for j in range(queries):
            whole = whole_row if reference_whole_row is None else reference_whole_row
            end = s if whole else s - queries + j + 1  # keys [0, end): at or before this query's position
            idx = req_to_token[r + 2, max(0, end - window) if window else 0 : end]
            kk = k_cache[idx].double().repeat_interleave(group, dim=1)  # [S, Hq, D]
            vv = v_cache[idx].double().repeat_interleave(group, dim=1)
            p = (torch.einsum("hd,shd->hs", q[r * queries + j].double(), kk) * scale).softmax(-1)
            ref = torch.einsum("hs,shd->hd", p, vv)
            assert (out[r * queries + j].double() - ref).abs().max() < tol, (r, j)


# ---- CPU: Triton's interpreter ----


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


@pytest.mark.parametrize(("queries", "num_kv_splits", "num_heads", "num_kv_heads", "window"), [
    (5, 1, 8, 2, None), (5, 6, 8, 2, None), (2, 3, 6, 2, 20), (4, 32, 4, 4, None), (9, 4, 8, 2, 30),
])
def test_verify_queries_attend_causally(queries: int, num_kv_splits: int, num_heads: int, num_kv_heads: int,
                                        window: int | None) -> None:
    """32 splits leave the first queries of short requests slices with no key of theirs."""
    check_verify_queries(queries, num_kv_splits, num_heads, num_kv_heads, 32, window, "cpu", torch.float32, 1e-4)


@pytest.mark.parametrize(("queries", "num_kv_splits", "num_heads", "num_kv_heads"), [(4, 1, 8, 2), (4, 32, 4, 4), (8, 3, 8, 2)])
def test_block_queries_see_the_whole_block(queries: int, num_kv_splits: int, num_heads: int, num_kv_heads: int) -> None:
    """A DLLM block through the decode kernel: every query of it sees all of its request's keys (the
    causal kernel does not: the reference tells them apart)."""
    args = (queries, num_kv_splits, num_heads, num_kv_heads, 32, None, "cpu", torch.float32, 1e-4)
    check_verify_queries(*args, whole_row=True)
    with pytest.raises(AssertionError):
        check_verify_queries(*args, whole_row=False, reference_whole_row=True)
    with pytest.raises(ValueError, match="no sliding window"):
        decode_attention(torch.zeros(4, 4, 16), torch.zeros(3, 2, 16), torch.zeros(3, 2, 16),
                         torch.zeros(1, 8, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.full((1,), 4),
                         0.25, 8, queries=4, whole_row=True)


def test_verify_queries_must_divide_the_rows() -> None:
    q, cache = torch.zeros(6, 4, 16), torch.zeros(3, 2, 16)
    table, lens = torch.zeros(2, 8, dtype=torch.int64), torch.full((2,), 3)
    with pytest.raises(ValueError, match="not 4 a request"):
        decode_attention(q, cache, cache, table, torch.zeros(2, dtype=torch.int64), lens, 0.25, queries=4)
    with pytest.raises(ValueError, match="no rotary"):
        decode_attention(q, cache, cache, table, torch.zeros(2, dtype=torch.int64), lens, 0.25, queries=3,
                         rotary=DecodeRotary(q[:, :2], q[:, :2], lens, torch.zeros(4, 16), lens))


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


# ---- GPU: compiled kernels, bfloat16 ----


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
@pytest.mark.parametrize(("queries", "num_kv_splits", "num_heads", "num_kv_heads", "head_dim", "window"), [
    (5, None, 32, 8, 128, None), (2, None, 32, 8, 128, None), (9, 12, 32, 8, 128, 30), (5, 1, 28, 4, 128, None),
    (5, 4, 16, 16, 256, None),
])
def test_verify_queries_attend_causally_gpu(queries: int, num_kv_splits: int | None, num_heads: int, num_kv_heads: int,
                                            head_dim: int, window: int | None) -> None:
    check_verify_queries(queries, num_kv_splits, num_heads, num_kv_heads, head_dim, window, "cuda", torch.bfloat16, 3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_kv_splits", "num_heads", "num_kv_heads", "head_dim", "window"), [
    (None, 32, 8, 128, None), (None, 32, 8, 64, None), (32, 32, 8, 64, None), (8, 8, 2, 64, 20), (5, 6, 2, 80, 100),
])
def test_decode_with_rotary_equals_rotary_then_decode_gpu(num_kv_splits: int | None, num_heads: int,
                                                          num_kv_heads: int, head_dim: int, window: int | None) -> None:
    check_decode_rotary(num_kv_splits, num_heads, num_kv_heads, head_dim, window, "cuda", torch.bfloat16, 2e-2)
