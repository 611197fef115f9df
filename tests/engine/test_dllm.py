"""Block diffusion (DLLM_EXTEND, SDAR-shaped models) on CPU: outputs token for token those of a plain
reference written here (the transformers Qwen3 model, full forwards over prefix + block under the
block-diffusion mask, no KV cache, and the LowConfidence rule), at block sizes 4 and 32, thresholds 0.95
and 0.0, page sizes 1 and 16, with prefix-cache hits and with preemption; seeded sampling is
batch-independent; stops end a request inside a block; the two model kinds refuse each other's modes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from modeserve.engine import LLM, SamplingParams
from modeserve.engine.forward_batch import ForwardBatch
from modeserve.engine.forward_mode import ForwardMode
from tests.engine.tiny_models import COMMON, load_reference, make_tiny_model, mixed_prompts

MASK = COMMON["vocab_size"] - 1
PROMPTS = [[t for t in p if t != MASK] for p in mixed_prompts(8, COMMON["vocab_size"], seed=3, max_len=40)]
BASE: dict[str, Any] = dict(kv_cache_tokens=4096, attention_backend="torch")


def make_sdar(folder: Path, block_size: int | None, mask: int | None = MASK) -> tuple[Path, torch.nn.Module]:
    """A tiny random Qwen3 model saved as an SDAR checkpoint (``block_size`` / ``mask_token_id`` in its
    config.json unless None), and the transformers Qwen3 model of the same weights."""
    make_tiny_model("qwen3", folder, head_dim=32)
    ref = load_reference(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["SDARForCausalLM"], model_type="sdar")
    cfg.update({k: v for k, v in (("block_size", block_size), ("mask_token_id", mask)) if v is not None})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, ref


@torch.no_grad()
def reference(model: torch.nn.Module, prompt: list[int], block: int, new: int, threshold: float) -> list[int]:
    """SDAR's generation, plainly: blocks at multiples of ``block`` from position 0, the prompt's last
    partial block filled with masks; each step a full forward over everything before the block and the
    block (a query sees keys up to the end of its own block), logits read at the masked positions
    themselves, the mask token excluded; unmask every position whose greedy token has probability >= ``threshold``, at least the
    most confident one (lowest position among equals)."""
    ids = list(prompt)
    while len(ids) - len(prompt) < new:
        start = len(ids) // block * block
        cur = ids[start:] + [MASK] * (block - (len(ids) - start))
        while MASK in cur:
            x = torch.tensor([ids[:start] + cur])
            pos = torch.arange(x.shape[1])
            allowed = pos[None, :] < (pos[:, None] // block + 1) * block
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
            logits = model(x, attention_mask=mask).logits[0, start:].float()
            logits[:, MASK] = float("-inf")  # never the mask token itself
            conf, tok = torch.softmax(logits, -1).max(-1)
            masked = [i for i in range(block) if cur[i] == MASK]
            take = [i for i in masked if conf[i] >= threshold] or sorted(masked, key=lambda i: (-float(conf[i]), i))[:1]
            for i in take:
                cur[i] = int(tok[i])
        ids = ids[:start] + cur
    return ids[len(prompt) : len(prompt) + new]


@pytest.fixture(scope="module", params=[4, 32])
def sdar(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, int]:
    folder, ref = make_sdar(tmp_path_factory.mktemp(f"sdar{request.param}"), request.param)
    return folder, ref, request.param


def greedy(new: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True, **kw)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("threshold", [0.95, 0.0])
def test_greedy_equals_the_reference(sdar: tuple[Path, torch.nn.Module, int], threshold: float, page_size: int) -> None:
    folder, ref, block = sdar
    new = 12 if block == 4 else 40  # three blocks of 4; two of 32 for most prompts
    llm = LLM(model=str(folder), page_size=page_size, dllm_threshold=threshold, **BASE)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(new))]
    assert got == [reference(ref, p, block, new, threshold) for p in PROMPTS]
    stats = llm.stats()
    assert set(stats["mode_distribution"]) == {"DLLM_EXTEND"}
    unmasked = stats["dllm_unmasked_per_step"]
    if threshold == 0.0:  # every block in one step
        assert max(unmasked) == block
    else:  # random weights are never that sure: one token a step
        assert set(unmasked) == {1}


def test_the_triton_kernels_block_causal_equal_the_reference(sdar: tuple[Path, torch.nn.Module, int],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The project's Triton kernels (Triton's CPU interpreter here): the extend kernel with its
    block-causal mask (prompts, a committed block with the next), the decode kernel with whole-row
    queries (the steps of one block a request, as their CUDA graphs run them)."""
    pytest.importorskip("triton")
    import modeserve.kernels.attention.triton_backend as backend

    calls = {"extend": 0, "block": 0}
    extend, decode = backend.extend_attention, backend.decode_attention

    def spy_extend(*args: Any) -> torch.Tensor:
        calls["extend"] += args[-1] > 0  # block-causal
        return extend(*args)

    def spy_decode(*args: Any) -> torch.Tensor:
        calls["block"] += bool(args[-1])  # whole_row
        return decode(*args)

    monkeypatch.setattr(backend, "extend_attention", spy_extend)
    monkeypatch.setattr(backend, "decode_attention", spy_decode)
    folder, ref, block = sdar
    # past a block's end: the committed block's KV rewritten beside the next block's first step
    new, prompts = (12, PROMPTS[:4]) if block == 4 else (34, PROMPTS[:2])
    llm = LLM(model=str(folder), page_size=16, kv_cache_tokens=4096, attention_backend="triton")
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy(new))]
    assert got == [reference(ref, p, block, new, 0.95) for p in prompts]
    assert calls["extend"] > 0 and calls["block"] > 0


def test_prefix_hits_and_preemption(tmp_path: Path) -> None:
    folder, ref = make_sdar(tmp_path / "sdar", 4)
    shared = list(range(3, 35))  # 32 tokens: whole blocks and pages
    prompts = [shared + p[:6] for p in PROMPTS]
    want = [reference(ref, p, 4, 12, 0.95) for p in prompts]
    cached = LLM(model=str(folder), page_size=4, **BASE)
    for _ in range(2):
        assert [o.token_ids for o in cached.generate(prompt_token_ids=prompts, sampling_params=greedy(12))] == want
    assert cached.stats()["num_prefix_hit_tokens"] >= 32 * len(prompts)
    small = LLM(model=str(folder), page_size=4, kv_cache_tokens=4 * 40, attention_backend="torch")
    assert [o.token_ids for o in small.generate(prompt_token_ids=prompts, sampling_params=greedy(12))] == want
    assert small.stats()["num_retractions"] > 0
    kv = small.scheduler.kv
    assert kv.pool.num_free_pages + (kv.cache.num_cached_pages if kv.cache else 0) == kv.pool.num_total_pages


def test_seeded_sampling_is_batch_independent(tmp_path: Path) -> None:
    folder, _ = make_sdar(tmp_path / "sdar", 4)
    llm = LLM(model=str(folder), page_size=4, dllm_threshold=0.5, **BASE)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_new_tokens=12, ignore_eos=True)
              for i in range(len(PROMPTS))]
    together = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    assert together == alone
    assert together != [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(12))]


def test_a_stop_inside_a_block_ends_the_request_at_it(tmp_path: Path) -> None:
    folder, ref = make_sdar(tmp_path / "sdar", 4)
    want = reference(ref, PROMPTS[0], 4, 12, 0.95)
    stop = want[5]  # inside the second block
    llm = LLM(model=str(folder), page_size=4, **BASE)
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=greedy(12, stop_token_ids=[stop]))[0]
    assert out.token_ids == want[: want.index(stop) + 1] and out.finish_reason == "stop"
    cut = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=greedy(6))[0]  # max_new_tokens mid-block
    assert cut.token_ids == want[:6] and cut.finish_reason == "length"
    kv = llm.scheduler.kv
    assert kv.pool.num_free_pages + (kv.cache.num_cached_pages if kv.cache else 0) == kv.pool.num_total_pages


def test_the_model_kinds_refuse_each_others_modes(tmp_path: Path) -> None:
    folder, _ = make_sdar(tmp_path / "sdar", 4)
    dllm = LLM(model=str(folder), page_size=4, **BASE)
    one = np.array([0])
    batch = ForwardBatch(ForwardMode.EXTEND, one, one, np.array([1]), np.array([True]), np.array([5]), one, np.array([4]))
    with pytest.raises(ValueError, match="DLLM_EXTEND steps only"):
        dllm.runner.compute_logits(batch)
    with pytest.raises(ValueError, match="logprobs"):
        dllm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(logprobs=2))
    plain = LLM(model=str(make_tiny_model("qwen3", tmp_path / "qwen3")), page_size=4, kv_cache_tokens=256)
    with pytest.raises(ValueError, match="autoregressive"):
        plain.runner.compute_logits(dataclasses.replace(batch, forward_mode=ForwardMode.DLLM_EXTEND))
    with pytest.raises(ValueError, match="autoregressive"):
        LLM(model=str(tmp_path / "qwen3"), dllm_block_size=4)
    bare, _ = make_sdar(tmp_path / "bare", None)
    with pytest.raises(ValueError, match="no block_size"):
        LLM(model=str(bare), **BASE)
    assert LLM(model=str(bare), dllm_block_size=8, **BASE).runner.dllm == (8, MASK)


def test_metrics_histogram_of_tokens_committed_per_step(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from modeserve.service.telemetry.metrics import RankSample, StepCollector

    folder, _ = make_sdar(tmp_path / "sdar", 4)
    llm = LLM(model=str(folder), page_size=4, dllm_threshold=0.0, **BASE)
    llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(8))
    registry = CollectorRegistry()
    registry.register(StepCollector(lambda: [RankSample("0", llm.scheduler.stats)], with_queue=False))
    text = generate_latest(registry).decode()
    blocks = sum(llm.stats()["dllm_unmasked_per_step"].values())
    assert f'modeserve_dllm_unmasked_tokens_count{{dp_rank="0"}} {float(blocks)}' in text
    assert f'modeserve_dllm_unmasked_tokens_bucket{{dp_rank="0",le="4.0"}} {float(blocks)}' in text  # <= a block
    assert 'modeserve_forward_steps_total{dp_rank="0",mode="DLLM_EXTEND"}' in text


def test_the_steps_graphs_do_not_take_run_in_pieces(sdar: tuple[Path, torch.nn.Module, int]) -> None:
    """The prompt blocks and a committed block beside the next go through the model in pieces (the piecewise
    graphs' split, run directly on CPU) with block-causal attention between them: the reference's tokens."""
    from modeserve.engine.runner.piecewise_graphs import PiecewiseExtend

    folder, ref, block = sdar
    new, prompts = (12, PROMPTS) if block == 4 else (34, PROMPTS[:4])
    llm = LLM(model=str(folder), page_size=16, **BASE)
    runner = llm.runner
    pieces = runner.piecewise = PiecewiseExtend(runner.model, runner.attn, 512, runner.device, runner.dtype,
                                                capture=False)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy(new))]
    assert got == [reference(ref, p, block, new, 0.95) for p in prompts]
    assert sum(pieces.hits.values()) == llm.stats()["mode_distribution"]["DLLM_EXTEND"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("block", [4, 32])
def test_fp32_cuda_equals_the_reference(tmp_path: Path, block: int) -> None:
    """On a GPU in fp32 (the Triton kernels: extend block-causal, decode with whole-row queries), the
    steps of one block a request replaying their CUDA graphs: the reference's tokens, and an eager
    engine's tokens and confidences step by step."""
    folder, ref = make_sdar(tmp_path / "sdar", block)
    new = 12 if block == 4 else 40
    kw: dict[str, Any] = dict(device="cuda", dtype="float32", page_size=16, kv_cache_tokens=4096,
                              attention_backend="triton")
    llm = LLM(model=str(folder), **kw)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(new))]
    assert got == [reference(ref, p, block, new, 0.95) for p in PROMPTS]
    graphs = llm.runner.dllm_graphs
    assert graphs is not None and graphs.hits["DLLM_EXTEND"] > 0 and llm.runner.graphs is None
    eager = LLM(model=str(folder), disable_cuda_graph=True, **kw)
    for engine in (llm, eager):
        for p in PROMPTS[:4]:
            engine.add_request(engine.make_request(p, greedy(new)))
    replays = graphs.hits["DLLM_EXTEND"]
    while llm.scheduler.has_work:
        a, b = llm.scheduler.schedule(), eager.scheduler.schedule()
        assert a is not None and b is not None and a.batch.forward_mode == b.batch.forward_mode
        ra, rb = llm.runner.forward(a.batch), eager.runner.forward(b.batch)
        np.testing.assert_array_equal(ra.next_token_ids, rb.next_token_ids)
        np.testing.assert_allclose(ra.confidences, rb.confidences, rtol=1e-4, atol=1e-6)
        llm.scheduler.process_result(a, ra)
        eager.scheduler.process_result(b, rb)
    assert graphs.hits["DLLM_EXTEND"] > replays and eager.runner.dllm_graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("block", [4, 32])
def test_fp32_cuda_pieces_equal_the_reference(tmp_path: Path, block: int) -> None:
    """With piecewise graphs on a GPU in fp32, the steps the DLLM_EXTEND graphs do not take (prompt blocks,
    a committed block beside the next) replay the pieces, block-causal attention between them: the
    reference's tokens."""
    folder, ref = make_sdar(tmp_path / "sdar", block)
    new = 12 if block == 4 else 40
    llm = LLM(model=str(folder), device="cuda", dtype="float32", page_size=16, kv_cache_tokens=4096,
              attention_backend="triton", enable_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=512)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(new))]
    assert got == [reference(ref, p, block, new, 0.95) for p in PROMPTS]
    graphs, pieces = llm.runner.dllm_graphs, llm.runner.piecewise
    assert graphs is not None and graphs.hits["DLLM_EXTEND"] > 0
    assert pieces is not None and sum(pieces.hits.values()) > 0
