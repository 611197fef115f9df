"""Tensor parallelism on CPU over gloo, two ranks (this process and a worker it starts; each holds half
the heads, MLP columns and LM head rows): greedy tokens
equal one rank's and the transformers full-forward argmax loop on every tiny architecture (and on a
GQA model with fewer KV heads than ranks, whose KV head is replicated), logits step by step within
1e-4 of one rank's; page size 1, prefix-cache hits and preemption; each rank holds only its share of
the weights; bad combinations are refused; a lost rank takes the engine out."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from modeserve.engine import LLM, SamplingParams
from tests.engine.tiny_models import (
    ARCHS,
    COMMON,
    load_reference,
    make_tiny_model,
    mixed_prompts,
    reference_greedy,
    teacher_forced_logits,
)

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama3", tmp_path_factory.mktemp("tiny-tp"))


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = mixed_prompts(8, COMMON["vocab_size"], seed=30, max_len=40)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    **{name: (name, {}) for name in sorted(ARCHS)},
    "llama3-one-kv-head": ("llama3", dict(num_key_value_heads=1)),  # fewer KV heads than ranks: replicated
}


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_two_ranks_equal_one_and_transformers(tmp_path: Path, name: str) -> None:
    arch, overrides = MODELS[name]
    folder = make_tiny_model(arch, tmp_path / name, **overrides)
    kw: dict[str, Any] = dict(page_size=16, kv_cache_tokens=2048)
    one, two = LLM(model=str(folder), **kw), LLM(model=str(folder), tensor_parallel_size=2, **kw)
    try:
        ref = load_reference(folder)
        want = [reference_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
        assert greedy(one, PROMPTS) == want
        assert greedy(two, PROMPTS) == want
        for llm in (two, one):  # the same requests again, stepped together: logits of every step
            for p in PROMPTS[:4]:
                llm.add_request(llm.make_request(p, GREEDY))
        assert {"EXTEND", "DECODE"} <= teacher_forced_logits(two, one, rtol=1e-4)
        # rank 0 holds half the heads and MLP columns; its KV cache half the KV heads (or the one, replicated)
        mc, local = one.model_config, two.runner.model_config
        assert (local.num_heads, local.intermediate_size) == (mc.num_heads // 2, mc.intermediate_size // 2)
        assert local.num_kv_heads == max(mc.num_kv_heads // 2, 1) == two.runner.kv_cache.k[0].shape[1]
        qkv = two.runner.model.layers[0].self_attn.qkv_proj.weight
        assert qkv.shape[0] == (local.num_heads + 2 * local.num_kv_heads) * mc.head_dim
        head, embedding = two.runner.model.lm_head.weight, two.runner.model.embed_tokens.weight
        assert head.shape[0] == mc.vocab_size // 2 and embedding.shape[0] == mc.vocab_size  # the head by vocabulary
        if mc.tie_word_embeddings:  # rank 0's head rows are the embedding's first half, not a copy
            assert head.data_ptr() == embedding.data_ptr()
    finally:
        two.close()


VARIANTS: dict[str, dict[str, Any]] = {
    "page1": dict(page_size=1, kv_cache_tokens=2048),
    "prefix_hits": dict(page_size=4, kv_cache_tokens=2048),
    "preemption": dict(page_size=4, kv_cache_tokens=160, max_running_requests=8),  # too small for all at once
    # TARGET_VERIFY steps (chained verify rows on the device: each rank resolves them alike)
    "ngram": dict(page_size=4, kv_cache_tokens=2048, speculative_algorithm="ngram"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_ranks_under_paging_prefix_hits_and_preemption(tiny_model: Path, variant: str) -> None:
    prompts = PROMPTS
    if variant == "ngram":
        prompts = [p * 3 for p in PROMPTS]  # repeats: prompt lookup finds drafts
    if variant == "prefix_hits":
        prompts = [PROMPTS[0] + p for p in PROMPTS]  # a shared prefix of PROMPTS[0]'s tokens
    two = LLM(model=str(tiny_model), tensor_parallel_size=2, **VARIANTS[variant])
    try:
        ref = load_reference(tiny_model)
        want = [reference_greedy(ref, p, NEW_TOKENS) for p in prompts]
        if variant == "prefix_hits":
            assert greedy(two, prompts[:1]) == want[:1]  # cached, then hit by every later prompt
            assert greedy(two, prompts[1:]) == want[1:]
            assert two.stats()["num_prefix_hit_tokens"] >= len(PROMPTS[0]) // 4 * 4 * (len(prompts) - 1)
        else:
            assert greedy(two, prompts) == want
        stats = two.stats()
        if variant == "preemption":
            assert stats["num_retractions"] > 0
        if variant == "ngram":
            assert stats["speculative"]["accepted_tokens"] > 0 and stats["speculative"]["chained_rows"] > 0

    finally:
        two.close()


def test_two_ranks_split_prefill_beside_decodes(tiny_model: Path) -> None:
    """Long prompts arriving while others decode run a slice of layers a step on both ranks."""
    two = LLM(model=str(tiny_model), tensor_parallel_size=2, page_size=4, kv_cache_tokens=2048,
              enable_split_prefill=True, split_prefill_min_tokens=24, split_prefill_token_budget=48)
    try:
        short = [two.make_request(p, GREEDY) for p in PROMPTS[:4]]
        for r in short:
            two.add_request(r)
        two.run_until(lambda: all(len(r.output_ids) >= 2 for r in short))
        long = [two.make_request((p * 8)[:120], GREEDY) for p in PROMPTS[4:]]  # 24 to 120 tokens
        for r in long:
            two.add_request(r)
        two.run_until(lambda: all(r.finished for r in short + long))
        ref = load_reference(tiny_model)
        assert [list(r.output_ids) for r in short + long] == [reference_greedy(ref, r.prompt_ids, NEW_TOKENS)
                                                               for r in short + long]
        assert two.stats()["mode_distribution"]["SPLIT_PREFILL"] >= 2 * len(long)
    finally:
        two.close()


def test_two_ranks_of_a_block_diffusion_model(tmp_path: Path) -> None:
    """DLLM_EXTEND steps (block-causal attention, a block's tokens and confidences a step) on two ranks:
    the single-rank engine's tokens, which are the reference's (tests/engine/test_dllm.py)."""
    from tests.engine.test_dllm import PROMPTS as DLLM_PROMPTS
    from tests.engine.test_dllm import greedy as dllm_greedy
    from tests.engine.test_dllm import make_sdar, reference

    folder, ref = make_sdar(tmp_path / "sdar", 4)
    two = LLM(model=str(folder), page_size=4, kv_cache_tokens=2048, tensor_parallel_size=2)
    try:
        got = [o.token_ids for o in two.generate(prompt_token_ids=DLLM_PROMPTS[:4], sampling_params=dllm_greedy(12))]
        assert got == [reference(ref, p, 4, 12, 0.95) for p in DLLM_PROMPTS[:4]]
        assert set(two.stats()["mode_distribution"]) == {"DLLM_EXTEND"}
    finally:
        two.close()


def test_two_ranks_sample_one_stream(tiny_model: Path) -> None:
    """Seeded sampling at two ranks (rank 0's draws given to the other) gives the streams of one rank."""
    sp = [SamplingParams(temperature=1.0, top_k=20, seed=s, max_new_tokens=NEW_TOKENS, ignore_eos=True)
          for s in range(len(PROMPTS))]
    one = LLM(model=str(tiny_model), page_size=4, kv_cache_tokens=2048)
    two = LLM(model=str(tiny_model), page_size=4, kv_cache_tokens=2048, tensor_parallel_size=2)
    try:
        want = [o.token_ids for o in one.generate(prompt_token_ids=PROMPTS, sampling_params=sp)]
        assert [o.token_ids for o in two.generate(prompt_token_ids=PROMPTS, sampling_params=sp)] == want
    finally:
        two.close()


def test_bad_combinations_are_refused(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        LLM(model=str(tiny_model), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(model=str(tiny_model), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="runs with tensor_parallel_size 1"):
        LLM(model=str(tiny_model), tensor_parallel_size=2, speculative_algorithm="draft",
            speculative_draft_model=str(tiny_model))
    with pytest.raises(ValueError, match="give device 'cuda' or 'cpu', not 'cuda:1'"):
        LLM(model=str(tiny_model), tensor_parallel_size=2, device="cuda:1")
    with pytest.raises(ValueError, match="not GGUF"):
        LLM(model=None, tensor_parallel_size=2)  # the embedded default model is a GGUF file


def test_a_lost_rank_fails_the_next_step(tiny_model: Path) -> None:
    two = LLM(model=str(tiny_model), page_size=4, kv_cache_tokens=512, tensor_parallel_size=2)
    assert greedy(two, PROMPTS[:2]) == greedy(LLM(model=str(tiny_model), page_size=4), PROMPTS[:2])
    workers = two.tp_workers
    assert workers is not None
    os.kill(workers.procs[0].pid, signal.SIGKILL)
    workers.procs[0].wait()
    with pytest.raises(RuntimeError):
        greedy(two, PROMPTS[:2])
    two.close()  # nothing left to stop: no hang, no error


def test_each_rank_reads_its_slice_of_a_tensor(tiny_model: Path) -> None:
    from modeserve.engine.models.loader import iter_weights, open_checkpoint
    from modeserve.engine.distributed.shard import weight_slice

    ckpt = open_checkpoint(tiny_model)
    full = dict(iter_weights(ckpt, torch.float32))
    for rank in range(2):
        part = dict(iter_weights(ckpt, torch.float32, lambda n: weight_slice(n, ckpt.config, rank, 2)))
        q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
        half = full[q].shape[0] // 2
        torch.testing.assert_close(part[q], full[q][rank * half:(rank + 1) * half], rtol=0, atol=0)
        torch.testing.assert_close(part[o], full[o][:, rank * half:(rank + 1) * half], rtol=0, atol=0)
        torch.testing.assert_close(part["model.norm.weight"], full["model.norm.weight"], rtol=0, atol=0)
        rows = full["lm_head.weight"].shape[0] // 2  # the head by vocabulary rows
        torch.testing.assert_close(part["lm_head.weight"], full["lm_head.weight"][rank * rows:(rank + 1) * rows],
                                   rtol=0, atol=0)


def test_an_idle_rank_waits_past_the_collective_timeout() -> None:
    """The other ranks wait for rank 0's next batch however long the engine idles: the all-reduce
    timeout (1 s here) does not apply to that wait."""
    import threading
    import time

    from modeserve.engine.distributed.group import TpGroup, tp_store

    store = tp_store(0, 2, "127.0.0.1", 0, timeout_s=1.0)  # a free port, bound here
    got: list[Any] = []

    def rank1() -> None:
        tp = TpGroup(1, tp_store(1, 2, "127.0.0.1", store.port, timeout_s=1.0), 2, torch.device("cpu"), timeout_s=1.0)
        got.append(tp.recv_step())
        got.append(tp.all_reduce(torch.ones(3)).tolist())

    t = threading.Thread(target=rank1)
    t.start()
    tp = TpGroup(0, store, 2, torch.device("cpu"), timeout_s=1.0)
    time.sleep(2.5)
    tp.send_step(("launch", [1, 2]))
    assert tp.all_reduce(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    t.join(10)
    assert got == [("launch", [1, 2]), [2.0, 2.0, 2.0]]


def test_a_rank_that_fails_to_start_is_an_error_at_once(tiny_model: Path) -> None:
    import time

    from modeserve.engine.distributed.launch import TpWorkers

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with 1 before the ranks joined"):
        TpWorkers(str(tiny_model), {}, 2, torch.device("cpu"), exit_on_loss=False, worker="modeserve.no_such_module")
    assert time.monotonic() - start < 30  # not the join's 600 s timeout
