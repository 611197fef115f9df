"""The triton attention backend equals the torch reference and dense float64 attention: DECODE,
EXTEND with a cached prefix (longer than one query block), MIXED, page sizes 1 and 16, GQA, sliding
window, and CUDA-graph-style ``init_capture``/``init_replay`` with padding (and, on a GPU, a really
captured graph, a step without host syncs, and the engine's logits against the torch backend's);
which backend ``auto`` and ``triton`` resolve to. The split-K decode kernel on its own is in
``test_triton_attention_decode``.

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

from tests.engine.tiny_models import COMMON, make_tiny_model, mixed_prompts, teacher_forced_logits
from tests.kernels.test_attention_backends import (
    HKV,
    HQ,
    D,
    dense_reference,
    make_case,
    run_backend,
)

KINDS = ["decode", "extend", "mixed", "verify"]
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


def fill_static(case: dict, rows: list[int], static: GraphInputs, qkv: tuple[torch.Tensor, ...],
                dtype: torch.dtype) -> AttentionInputs:
    """``replay_inputs``, and the rows' q/k/v written into the static ``qkv`` buffers (the rest zero)."""
    for buf, real in zip(qkv, (case["q"], case["k"], case["v"])):
        buf.zero_()
        buf[: len(rows)] = real[rows]
    return replay_inputs(case, rows, static, dtype)


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
        inputs = fill_static(case, rows, static, (static_q, static_k, static_v), dtype)
        backend.init_replay(inputs, bs)
        backend.init_forward_metadata(decode_inputs(case, [0], device, dtype))  # another step between
        backend.init_replay(inputs, bs)
        with pytest.raises(ValueError, match="slot table it was captured with"):
            backend.init_replay(AttentionInputs(**{**inputs.__dict__, "req_to_token": inputs.req_to_token.clone()}),
                                bs)
        out = backend.forward(static_q, static_k, static_v, 0)
        assert torch.isfinite(out).all()
        assert (out[:n].double() - dense[rows]).abs().max() < tol


def check_verify_graph_replay(page_size: int, device: str, dtype: torch.dtype, window: int | None, tol: float) -> None:
    """A TARGET_VERIFY graph's hooks (5 queries a request, 4 requests padded to a bucket of 6): the
    real rows, read from the static buffers only, match dense causal attention."""
    case = make_case("verify", page_size, device, dtype)
    cache = make_cache(case, page_size, device, dtype)
    backend = create_attention_backend("triton", torch.device(device), dtype, kv_cache=cache, num_heads=HQ,
                                       scale=1 / math.sqrt(D), sliding_window=window)
    bs, q, rows = 6, 5, [3, 0, 4, 1]
    n, table = len(rows), case["req_to_token"]
    z = torch.zeros(q * bs, dtype=torch.int64, device=device)
    static = GraphInputs(z.clone(), z[:bs].clone(), torch.full((bs,), q, device=device), table, q)
    static_q = [torch.zeros(q * bs, h, D, dtype=dtype, device=device) for h in (HQ, HKV, HKV)]
    backend.init_capture(bs, static)
    assert torch.isfinite(backend.forward(*static_q, 0)).all()  # warm-up: padding rows
    tokens = torch.tensor([r * q + j for r in rows for j in range(q)], device=device)
    static.req_pool_indices[:n] = torch.tensor(rows, device=device)
    static.seq_lens[:n] = torch.tensor([case["seq"][r] for r in rows], device=device)
    static.out_cache_loc[: q * n] = case["out_loc"][tokens]
    for buf, real in zip(static_q, (case["q"], case["k"], case["v"])):
        buf[: q * n] = real[tokens]
    backend.init_replay(AttentionInputs(ForwardMode.TARGET_VERIFY, static.req_pool_indices[:n],
                                        [case["prefix"][r] for r in rows], [q] * n, static.seq_lens[:n],
                                        static.out_cache_loc[: q * n], table, dtype), bs)
    out = backend.forward(*static_q, 0)
    assert (out[: q * n].double() - dense_reference(case, window)[tokens]).abs().max() < tol


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


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_verify_graph_hooks(page_size: int, window: int | None) -> None:
    check_verify_graph_replay(page_size, "cpu", torch.float32, window, 1e-4)


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
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_graph_hooks_gpu(page_size: int, window: int | None) -> None:
    check_graph_replay(page_size, "cuda", torch.bfloat16, window, 3e-2)
    check_verify_graph_replay(page_size, "cuda", torch.bfloat16, window, 3e-2)


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
        inputs = fill_static(case, rows, static, (static_q, static_k, static_v), dtype)
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
