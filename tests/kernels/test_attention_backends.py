"""Every attention backend equals the torch reference on the same paged KV cache: DECODE, EXTEND
with a cached prefix, MIXED, sliding window, page sizes 1 and 16. The torch reference itself is
checked against plain dense attention."""

from __future__ import annotations

import math

import pytest
import torch

from modeserve.engine.forward_mode import ForwardMode
from modeserve.kernels.attention.base import (
    CATCH_UP_QUERIES,
    AttentionBackend,
    AttentionInputs,
    GraphInputs,
    create_attention_backend,
)
from modeserve.kernels.attention.kv_cache import KVCache

HQ, HKV, D = 8, 2, 64


def make_case(kind: str, page_size: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    if kind == "decode":
        prefix, ext = [5, 17, 33, 64, 1], [1, 1, 1, 1, 1]
    elif kind == "prefill":  # no cached prefix in any row
        prefix, ext = [0, 0, 0], [9, 20, 33]
    elif kind == "verify":  # a TARGET_VERIFY step: each request's last token and 4 drafts
        prefix, ext = [4, 16, 33, 60, 0], [5, 5, 5, 5, 5]
    elif kind == "extend":
        prefix, ext = [0, 16, 7, 32], [9, 5, 20, 1]
    else:  # mixed: prefill chunks and decodes
        prefix, ext = [0, 24, 40, 3, 50], [12, 8, 1, 1, 1]
    seq = [p + e for p, e in zip(prefix, ext)]
    max_ctx = 128
    pages_per_req = [math.ceil(s / page_size) for s in seq]
    num_pages = sum(pages_per_req) + 8
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0 reserved
    req_to_token = torch.zeros(len(seq), max_ctx, dtype=torch.int64)
    out_loc, used = [], 0
    for r, (p, s) in enumerate(zip(prefix, seq)):
        pages = perm[used : used + pages_per_req[r]]
        used += pages_per_req[r]
        slots = torch.tensor([pages[i // page_size] * page_size + i % page_size for i in range(s)])
        req_to_token[r, :s] = slots
        out_loc.append(slots[p:s])
    t = sum(ext)
    k_hist = torch.randn(num_pages * page_size, HKV, D, generator=g)
    v_hist = torch.randn(num_pages * page_size, HKV, D, generator=g)
    return dict(
        mode=ForwardMode.TARGET_VERIFY if kind == "verify" else None, prefix=prefix, ext=ext, seq=seq, req_to_token=req_to_token.to(device), out_loc=torch.cat(out_loc).to(device),
        num_slots=num_pages * page_size, k_hist=k_hist.to(device, dtype), v_hist=v_hist.to(device, dtype),
        q=torch.randn(t, HQ, D, generator=g).to(device, dtype), k=torch.randn(t, HKV, D, generator=g).to(device, dtype),
        v=torch.randn(t, HKV, D, generator=g).to(device, dtype),
    )


def run_backend(name: str, case: dict, page_size: int, device: str, dtype: torch.dtype,
                window: int | None = None, **backend_kwargs: object) -> torch.Tensor:
    """``backend_kwargs``: build the FlashInfer backend with these options instead of by name."""
    cache = KVCache(1, case["num_slots"], HKV, D, page_size, dtype, torch.device(device))
    cache.k[0].copy_(case["k_hist"])
    cache.v[0].copy_(case["v_hist"])
    if backend_kwargs:
        from modeserve.kernels.attention.flashinfer_backend import FlashInferAttentionBackend

        backend: AttentionBackend = FlashInferAttentionBackend(cache, HQ, 1 / math.sqrt(D), window, **backend_kwargs)
    else:
        backend = create_attention_backend(name, torch.device(device), dtype, kv_cache=cache, num_heads=HQ,
                                           scale=1 / math.sqrt(D), sliding_window=window)
    ext = case["ext"]
    mode = ForwardMode.DECODE if all(e == 1 for e in ext) else case.get("mode") or ForwardMode.MIXED
    backend.init_forward_metadata(AttentionInputs(
        forward_mode=mode, req_pool_indices=torch.arange(len(ext), device=device), prefix_lens_cpu=case["prefix"],
        extend_lens_cpu=ext, seq_lens=torch.tensor(case["seq"], device=device), out_cache_loc=case["out_loc"],
        req_to_token=case["req_to_token"], dtype=dtype))
    return backend.forward(case["q"], case["k"], case["v"], 0)


def dense_reference(case: dict, window: int | None) -> torch.Tensor:
    """Plain float64 attention per request over [history | new] keys, causal, optional window."""
    k_all = case["k_hist"].double().clone()
    v_all = case["v_hist"].double().clone()
    k_all[case["out_loc"]] = case["k"].double()
    v_all[case["out_loc"]] = case["v"].double()
    outs, start = [], 0
    for r, (p, e, s) in enumerate(zip(case["prefix"], case["ext"], case["seq"])):
        slots = case["req_to_token"][r, :s]
        kk = k_all[slots].repeat_interleave(HQ // HKV, dim=1)  # [S, Hq, D]
        vv = v_all[slots].repeat_interleave(HQ // HKV, dim=1)
        qq = case["q"][start : start + e].double()  # [E, Hq, D]
        scores = torch.einsum("ehd,shd->hes", qq, kk) / math.sqrt(D)
        q_pos = torch.arange(p, s, device=qq.device)[:, None]
        k_pos = torch.arange(s, device=qq.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= q_pos - k_pos < window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        outs.append(torch.einsum("hes,shd->ehd", scores.softmax(-1), vv))
        start += e
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["decode", "prefill", "extend", "mixed", "verify"])
def test_torch_reference_equals_dense_attention(kind: str, page_size: int, window: int | None) -> None:
    case = make_case(kind, page_size, "cpu", torch.float32)
    out = run_backend("torch", case, page_size, "cpu", torch.float32, window)
    torch.testing.assert_close(out.double(), dense_reference(case, window), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["decode", "prefill", "extend", "mixed", "verify"])
@pytest.mark.parametrize("backend", ["flashinfer", "flashinfer-triton"])
def test_flashinfer_equals_torch_reference(backend: str, kind: str, page_size: int, window: int | None) -> None:
    pytest.importorskip("flashinfer")
    case = make_case(kind, page_size, "cuda", torch.bfloat16)
    ref = run_backend("torch", case, page_size, "cuda", torch.bfloat16, window)
    out = run_backend(backend, case, page_size, "cuda", torch.bfloat16, window)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    dense = dense_reference(case, window).float()
    assert (out.float() - dense).abs().max() < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_decode_kernels_both_ways(page_size: int, tensor_cores: bool) -> None:
    """DECODE through FlashInfer's tensor-core (prefill) kernel and through its decode kernel, whichever
    the group-size rule would pick: both equal dense attention."""
    pytest.importorskip("flashinfer")
    case = make_case("decode", page_size, "cuda", torch.bfloat16)
    out = run_backend("flashinfer", case, page_size, "cuda", torch.bfloat16, None, decode_tensor_cores=tensor_cores)
    assert (out.float() - dense_reference(case, None).float()).abs().max() < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_prefill_without_prefix_attends_to_the_steps_own_keys(page_size: int) -> None:
    """A prefill with no cached prefix reads the k/v it is given (ragged), not the cache: told they
    are stored while the cache still holds other keys at those slots, it still equals dense attention
    over the given keys; with a prefix it reads the cache (paged), so there the same call must not."""
    pytest.importorskip("flashinfer")
    from modeserve.kernels.attention.flashinfer_backend import FlashInferAttentionBackend

    results = {}
    for kind in ("prefill", "extend"):
        case = make_case(kind, page_size, "cuda", torch.bfloat16)
        cache = KVCache(1, case["num_slots"], HKV, D, page_size, torch.bfloat16, torch.device("cuda"))
        cache.k[0].copy_(case["k_hist"])  # the slots of this step's keys hold history, not case["k"]
        cache.v[0].copy_(case["v_hist"])
        backend = FlashInferAttentionBackend(cache, HQ, 1 / math.sqrt(D), None)
        backend.init_forward_metadata(AttentionInputs(
            forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.arange(len(case["ext"]), device="cuda"),
            prefix_lens_cpu=case["prefix"], extend_lens_cpu=case["ext"], seq_lens=torch.tensor(case["seq"], device="cuda"),
            out_cache_loc=case["out_loc"], req_to_token=case["req_to_token"], dtype=torch.bfloat16))
        out = backend.forward(case["q"], case["k"], case["v"], 0, kv_stored=True)
        results[kind] = float((out.float() - dense_reference(case, None).float()).abs().max())
    assert results["prefill"] < 3e-2
    assert results["extend"] > 0.1


class _Recorder(AttentionBackend):
    """Records which hook ran; attention itself is the torch reference's."""

    def __init__(self, name: str, calls: list[tuple[str, str, int]], inner: AttentionBackend) -> None:
        super().__init__(inner.kv_cache, inner.num_heads, inner.scale, inner.sliding_window)
        self.name, self.calls, self.inner = name, calls, inner

    def init_forward_metadata(self, inputs: AttentionInputs) -> None:
        self.calls.append((self.name, "plan", len(inputs.extend_lens_cpu)))
        self.inner.init_forward_metadata(inputs)

    def init_capture(self, bs: int, static: GraphInputs) -> None:
        self.calls.append((self.name, "capture", bs))

    def init_replay(self, inputs: AttentionInputs, bs: int) -> None:
        self.calls.append((self.name, "replay", bs))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False) -> torch.Tensor:
        self.calls.append((self.name, "forward", q.shape[0]))
        return self.inner.forward(q, k, v, layer_id, kv_stored)


def test_flashinfer_triton_routes_by_mode_and_batch_size() -> None:
    """Extends and MIXED go to FlashInfer, decodes and verify steps of k drafts a request of up to
    TRITON_DECODE_MAX_ROWS query rows to Triton (graph buckets too), bigger ones and uneven verify
    steps to FlashInfer; the chosen backend computes the answer."""
    from modeserve.kernels.attention.flashinfer_triton_backend import (
        TRITON_DECODE_MAX_ROWS,
        FlashInferTritonAttentionBackend,
    )

    calls: list[tuple[str, str, int]] = []
    for kind in ("mixed", "decode"):
        case = make_case(kind, 16, "cpu", torch.float32)
        cache = KVCache(1, case["num_slots"], HKV, D, 16, torch.float32, torch.device("cpu"))
        cache.k[0].copy_(case["k_hist"])
        cache.v[0].copy_(case["v_hist"])
        ref = create_attention_backend("torch", torch.device("cpu"), torch.float32, kv_cache=cache, num_heads=HQ,
                                       scale=1 / math.sqrt(D), sliding_window=None)
        hybrid = FlashInferTritonAttentionBackend(cache, HQ, 1 / math.sqrt(D), None,
                                                  flashinfer=_Recorder("flashinfer", calls, ref),
                                                  triton=_Recorder("triton", calls, ref))
        ext = case["ext"]
        hybrid.init_forward_metadata(AttentionInputs(
            forward_mode=ForwardMode.DECODE if kind == "decode" else ForwardMode.MIXED,
            req_pool_indices=torch.arange(len(ext)), prefix_lens_cpu=case["prefix"], extend_lens_cpu=ext,
            seq_lens=torch.tensor(case["seq"]), out_cache_loc=case["out_loc"], req_to_token=case["req_to_token"],
            dtype=torch.float32))
        out = hybrid.forward(case["q"], case["k"], case["v"], 0)
        torch.testing.assert_close(out.double(), dense_reference(case, None), rtol=1e-5, atol=1e-5)
        expected = "flashinfer" if kind == "mixed" else "triton"
        assert calls[-2:] == [(expected, "plan", len(ext)), (expected, "forward", case["q"].shape[0])]
    loc = torch.zeros(3 * (TRITON_DECODE_MAX_ROWS + 1), dtype=torch.int64)
    for q in (1, 3):  # decode and verify graphs (k + 1 queries a request) by their query rows
        for bs in (1, 256, TRITON_DECODE_MAX_ROWS, TRITON_DECODE_MAX_ROWS + 1):
            hybrid.init_capture(bs, GraphInputs(loc[: q * bs], loc[:bs], loc[:bs], case["req_to_token"], q))
            mode = ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY
            hybrid.init_replay(AttentionInputs(mode, loc[:bs], [0] * bs, [q] * bs, loc[:bs], loc[: q * bs],
                                               case["req_to_token"], torch.float32), bs)
            name = "triton" if bs * q <= TRITON_DECODE_MAX_ROWS else "flashinfer"
            assert calls[-2:] == [(name, "capture", bs), (name, "replay", bs)]
    for ext, name in (([3, 3], "triton"), ([3, 2], "flashinfer")):  # eager verify steps: k drafts each, or not
        hybrid.init_forward_metadata(AttentionInputs(ForwardMode.TARGET_VERIFY, loc[:2], [5, 5], ext, loc[:2],
                                                     loc[: sum(ext)], case["req_to_token"], torch.float32))
        assert calls[-1] == (name, "plan", 2)
    # a draft's catch-up (its last two tokens a request) takes the kernel its graphs capture it with,
    # eager too; a DRAFT_EXTEND of other lengths (the draft's prefill beside an EXTEND) is an extend
    hybrid.init_capture(2, GraphInputs(loc[:4], loc[:2], loc[:2], case["req_to_token"], CATCH_UP_QUERIES))
    assert calls[-1] == ("triton", "capture", 2)
    for ext, name in (([2, 2], "triton"), ([3, 3], "flashinfer"), ([2, 1], "flashinfer")):
        hybrid.init_forward_metadata(AttentionInputs(ForwardMode.DRAFT_EXTEND, loc[:2], [5, 5], ext, loc[:2],
                                                     loc[: sum(ext)], case["req_to_token"], torch.float32))
        assert calls[-1] == (name, "plan", 2)
