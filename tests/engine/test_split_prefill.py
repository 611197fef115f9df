"""SPLIT_PREFILL on CPU: a prefill run a slice of layers a step writes the KV cache and gives the logits
of one EXTEND (and of transformers); greedy outputs of long prompts arriving while others decode are
those of split prefill off and of the transformers full-forward argmax loop, at page sizes 1 and 16,
with prefix-cache hits and with chunked prefill; abort and preemption in the middle of a split free
everything it held, on the scheduler's KV pool and in the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from modeserve.engine import LLM, SamplingParams
from modeserve.engine.forward_batch import ForwardBatch, LayerRange, ReqAdmission
from modeserve.engine.forward_mode import ForwardMode
from modeserve.engine.request import Req
from tests.engine.tiny_models import ARCHS, load_reference, make_tiny_model, reference_greedy, reference_logits

NUM_LAYERS = 4
KV_JUST_FITS = 180  # token slots: the short requests' and the long prompt's, and a few more
NEW_TOKENS = 12
SHORT_TOKENS = 48  # the short requests outlive the long ones' split prefills
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
SHORT_GREEDY = SamplingParams(temperature=0.0, max_new_tokens=SHORT_TOKENS, ignore_eos=True)
# budget 100 over prompts of 60..120 tokens: one layer a slice, four slices a prompt
SPLIT: dict[str, Any] = dict(enable_split_prefill=True, split_prefill_min_tokens=40, split_prefill_token_budget=100)


def _prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


SHORT = _prompts(1, [5, 9, 14, 20])  # decoding when the long ones arrive
LONG = _prompts(2, [60, 75, 90, 120])


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), num_hidden_layers=NUM_LAYERS)
    ref = load_reference(folder)
    return folder, [reference_greedy(ref, p, SHORT_TOKENS) for p in SHORT] + [reference_greedy(ref, p, NEW_TOKENS)
                                                                              for p in LONG]


def mixed_workload(llm: LLM, short: list[list[int]], long: list[list[int]],
                   run: Callable[[Callable[[], bool]], None] | None = None) -> list[list[int]]:
    """The short prompts decode a few tokens; then the long ones arrive and ``run`` (default: the
    engine's loop) steps until every request is finished; every output."""
    first = [llm.make_request(p, SHORT_GREEDY) for p in short]
    for r in first:
        llm.add_request(r)
    llm.run_until(lambda: all(len(r.output_ids) >= 3 for r in first))
    later = [llm.make_request(p, GREEDY) for p in long]
    for r in later:
        llm.add_request(r)
    (run or llm.run_until)(lambda: all(r.finished for r in first + later))
    return [list(r.output_ids) for r in first + later]


VARIANTS: dict[str, dict[str, Any]] = {
    "page1": dict(page_size=1),
    "page16": dict(page_size=16),
    "prefix_hits": dict(page_size=4),  # the long prompts share a prefix with the short ones
    "chunked": dict(page_size=4, chunked_prefill_size=48),  # each 48-token chunk is split in turn
    "three_decodes_a_slice": dict(page_size=4, split_prefill_decode_steps=3),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mixed_workload_equals_split_off_and_transformers(arch: tuple[Path, list[list[int]]], variant: str) -> None:
    folder, want = arch
    kwargs = dict(kv_cache_tokens=4096, **VARIANTS[variant])
    short, long = SHORT, LONG
    if variant == "prefix_hits":
        long = [SHORT[3] + p[: 60] for p in LONG]  # 20 cached tokens each
        ref = load_reference(folder)
        want = want[: len(SHORT)] + [reference_greedy(ref, p, NEW_TOKENS) for p in long]
    plain = LLM(model=str(folder), **kwargs)
    assert mixed_workload(plain, short, long) == want
    llm = LLM(model=str(folder), **SPLIT, **kwargs)
    assert mixed_workload(llm, short, long) == want
    stats = llm.stats()
    slices, tokens = stats["mode_distribution"]["SPLIT_PREFILL"], stats["tokens_by_mode"]["SPLIT_PREFILL"]
    if variant == "chunked":  # the chunks of 40 tokens or more are split, one layer a slice
        assert slices % NUM_LAYERS == 0 and slices >= NUM_LAYERS and 48 <= tokens < sum(map(len, long))
    else:  # every long prompt split, one layer a slice; each split prefill's tokens count once
        assert slices == NUM_LAYERS * len(long)
        assert tokens == sum(map(len, long)) - 20 * len(long) * (variant == "prefix_hits")
    assert "SPLIT_PREFILL" not in plain.stats()["mode_distribution"]
    if variant == "prefix_hits":
        assert stats["num_prefix_hit_tokens"] >= 20 * len(long)
    assert llm.runner.split.held_slots == ()


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_split_prefill_with_speculative_decoding(tiny_llama_4: Path, algorithm: str) -> None:
    """Verify steps between the slices (n-gram drafts; or a draft model, whose DRAFT_EXTEND runs with the
    first slice): the outputs are still transformers' greedy ones."""
    spec: dict[str, Any] = dict(speculative_algorithm=algorithm)
    if algorithm == "draft":
        spec["speculative_draft_model"] = str(tiny_llama_4)
    llm = LLM(model=str(tiny_llama_4), page_size=4, kv_cache_tokens=4096, **spec, **SPLIT)
    short = [p * 3 for p in SHORT]  # repeats: n-gram drafts
    ref = load_reference(tiny_llama_4)
    want = [reference_greedy(ref, p, SHORT_TOKENS) for p in short] + [reference_greedy(ref, p, NEW_TOKENS) for p in LONG]
    assert mixed_workload(llm, short, LONG) == want
    stats = llm.stats()
    # the first long prompt is split a layer a slice; later ones in fewer slices once nothing decodes
    assert stats["mode_distribution"]["SPLIT_PREFILL"] >= NUM_LAYERS
    assert stats["mode_distribution"]["TARGET_VERIFY"] > 0 and stats["speculative"]["accepted_tokens"] > 0
    if algorithm == "draft":  # the draft's prefill of every prompt: the shorts' EXTEND and each split's first slice
        assert stats["tokens_by_mode"]["DRAFT_EXTEND"] >= sum(map(len, short + LONG))


def _extend_batch(prompt: list[int], mode: ForwardMode, layers: LayerRange | None, slot: int,
                  admit: bool) -> ForwardBatch:
    n = len(prompt)
    return ForwardBatch(
        forward_mode=mode, req_pool_indices=np.array([slot]), prefix_lens=np.array([0]), extend_lens=np.array([n]),
        sample_mask=np.array([layers is None or layers.end == NUM_LAYERS]), input_ids=np.array(prompt),
        positions=np.arange(n), out_cache_loc=np.arange(16, 16 + n),
        admissions=(ReqAdmission(slot, GREEDY, 0, n),) if admit else (), split_layers=layers)


def test_split_writes_the_kv_and_logits_of_one_extend(arch: tuple[Path, list[list[int]]]) -> None:
    folder, _ = arch
    prompt = LONG[1]
    one, split = (LLM(model=str(folder), page_size=1, kv_cache_tokens=512).runner for _ in range(2))
    want = one.compute_logits(_extend_batch(prompt, ForwardMode.EXTEND, None, 0, True))
    slices = [LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4)]
    for i, layers in enumerate(slices):
        got = split.compute_logits(_extend_batch(prompt, ForwardMode.SPLIT_PREFILL, layers, 0, i == 0))
        assert got.shape[0] == (1 if layers.end == NUM_LAYERS else 0)
        written = torch.arange(16, 16 + len(prompt))
        for layer in range(NUM_LAYERS):  # layers up to this slice's end hold the prompt's keys and values
            for a, b in ((one.kv_cache.k[layer], split.kv_cache.k[layer]), (one.kv_cache.v[layer], split.kv_cache.v[layer])):
                if layer < layers.end:
                    torch.testing.assert_close(b[written], a[written], rtol=0, atol=1e-6)
                else:
                    assert not torch.equal(b[written], a[written])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    ref = reference_logits(load_reference(folder), prompt)
    torch.testing.assert_close(got[0], ref, rtol=0, atol=1e-4 * float(ref.abs().max()))
    assert split.split.held_slots == ()


def test_a_slice_that_continues_nothing_is_refused(tiny_split: LLM) -> None:
    runner = tiny_split.runner
    prompt = LONG[0]
    with pytest.raises(ValueError, match="continue no split prefill"):
        runner.compute_logits(_extend_batch(prompt, ForwardMode.SPLIT_PREFILL, LayerRange(1, 2), 0, True))
    runner.compute_logits(_extend_batch(prompt, ForwardMode.SPLIT_PREFILL, LayerRange(0, 2), 0, True))
    with pytest.raises(ValueError, match="next layer 2"):
        runner.compute_logits(_extend_batch(prompt, ForwardMode.SPLIT_PREFILL, LayerRange(3, 4), 0, False))
    with pytest.raises(ValueError, match="within"):
        runner.compute_logits(_extend_batch(prompt, ForwardMode.SPLIT_PREFILL, LayerRange(2, 9), 0, False))
    assert runner.split.held_slots == (0,)  # the refused slices changed nothing
    assert runner.compute_logits(_extend_batch(prompt, ForwardMode.SPLIT_PREFILL, LayerRange(2, 4), 0, False)).shape[0] == 1


@pytest.fixture()
def tiny_split(tiny_llama_4: Path) -> LLM:
    return LLM(model=str(tiny_llama_4), page_size=4, kv_cache_tokens=4096, **SPLIT)


@pytest.fixture(scope="module")
def tiny_llama_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama3", tmp_path_factory.mktemp("tiny4"), num_hidden_layers=NUM_LAYERS)


def _idle(llm: LLM) -> bool:
    kv = llm.scheduler.kv
    cached = kv.cache.num_cached_pages if kv.cache is not None else 0
    return kv.pool.num_free_pages + cached == kv.pool.num_total_pages


def _start_split(llm: LLM) -> tuple[list[Req], Req]:
    """Short requests decoding and a long one two slices into its split prefill."""
    first = [llm.make_request(p, SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)) for p in SHORT]
    for r in first:
        llm.add_request(r)
    llm.run_until(lambda: all(len(r.output_ids) >= 2 for r in first))
    long = llm.make_request(LONG[3], GREEDY)
    llm.add_request(long)
    while llm.stats()["mode_distribution"].get("SPLIT_PREFILL", 0) < 2:
        llm.step()
    assert not long.finished and not long.output_ids
    return first, long


def test_abort_in_the_middle_frees_the_kv_and_the_engine_state(tiny_split: LLM) -> None:
    llm = tiny_split
    first, long = _start_split(llm)
    assert llm.runner.split.held_slots == (long.req_pool_idx,)
    assert llm.abort(long.rid)
    llm.step()  # the next batch tells the engine
    assert llm.runner.split.held_slots == ()
    llm.run_until(lambda: all(r.finished for r in first))
    assert llm.stats()["mode_distribution"]["SPLIT_PREFILL"] == 2 and long.finish_reason == "abort"
    assert _idle(llm)


def test_preemption_in_the_middle_recomputes_the_prompt(tiny_llama_4: Path) -> None:
    # a pool the long prompt just fits in: the decoders' next tokens preempt the newest request, the split one
    llm = LLM(model=str(tiny_llama_4), page_size=1, kv_cache_tokens=KV_JUST_FITS, enable_prefix_cache=False, **SPLIT)
    first, long = _start_split(llm)
    while not long.num_retractions:
        assert not long.output_ids, "the split prefill finished before it was preempted"
        llm.step()
    llm.step()
    assert llm.runner.split.held_slots == ()
    llm.run_until(lambda: all(r.finished for r in [*first, long]))
    ref = load_reference(tiny_llama_4)
    assert list(long.output_ids) == reference_greedy(ref, LONG[3], NEW_TOKENS)
    assert [list(r.output_ids) for r in first] == [reference_greedy(ref, p, 40) for p in SHORT]
    assert _idle(llm) and llm.runner.split.held_slots == ()


OVERLAP: dict[str, dict[str, Any]] = {
    "turns": {},
    "beside": dict(enable_split_prefill_overlap=True),
    "beside_three_decodes": dict(enable_split_prefill_overlap=True, split_prefill_decode_steps=3),
    "beside_on_16_sms": dict(enable_split_prefill_overlap=True, split_prefill_overlap_sms=16),
    "beside_on_16_sms_triton_gemms": dict(enable_split_prefill_overlap=True, split_prefill_overlap_sms=16,
                                          small_batch_gemm="triton"),
    # the decodes on the 16 SMs the slices leave, in a green context of their own, while a slice runs
    "beside_on_16_sms_confined": dict(enable_split_prefill_overlap=True, split_prefill_overlap_sms=16,
                                      split_prefill_confine_decodes=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("setting", sorted(OVERLAP))
def test_cuda_split_prefill_beside_decode_graphs_equals_split_off(tiny_llama_4: Path, setting: str) -> None:
    """On a GPU, in fp32 (the Triton backend): the decode steps between the slices replay their CUDA graphs
    (beside: while the slices run on a stream of their own, on a partition of the SMs or not), and the outputs
    are those of split prefill off and of transformers."""
    pytest.importorskip("triton")
    overlap = bool(OVERLAP[setting])
    kwargs: dict[str, Any] = dict(device="cuda", dtype="float32", page_size=16, kv_cache_tokens=4096,
                                  attention_backend="triton", max_running_requests=16)
    ref = load_reference(tiny_llama_4)
    want = [reference_greedy(ref, p, SHORT_TOKENS) for p in SHORT] + [reference_greedy(ref, p, NEW_TOKENS) for p in LONG]
    assert mixed_workload(LLM(model=str(tiny_llama_4), **kwargs), SHORT, LONG) == want
    llm = LLM(model=str(tiny_llama_4), **OVERLAP[setting], **SPLIT, **kwargs)
    assert (llm.runner.side_stream is not None) == overlap
    assert mixed_workload(llm, SHORT, LONG) == want
    assert llm.stats()["mode_distribution"]["SPLIT_PREFILL"] == NUM_LAYERS * len(LONG)
    assert llm.runner.graphs is not None and llm.runner.graphs.hits["DECODE"] > 0 and llm.runner.split.held_slots == ()
    confine = bool(OVERLAP[setting].get("split_prefill_confine_decodes"))
    assert sorted(llm.runner.graphs.confined) == (sorted(llm.runner.graphs.graphs) if confine else [])


@pytest.mark.gpu
def test_cuda_bf16_flashinfer_split_writes_the_kv_and_logits_of_one_extend(tmp_path: Path) -> None:
    """The serving default on a GPU (bf16, FlashInfer extends): slices of layers write the KV of one EXTEND
    and give its logits (the same kernels on the same rows), and a mixed workload with split prefill
    replays the decode graphs between the slices, with the slices on a stream of their own gives the
    tokens of the slices taking turns, and frees everything after."""
    for module in ("flashinfer", "triton"):
        pytest.importorskip(module)
    folder = make_tiny_model("llama3", tmp_path / "m", num_hidden_layers=NUM_LAYERS, head_dim=64)  # FlashInfer: 64/128/256
    kwargs: dict[str, Any] = dict(device="cuda", dtype="bfloat16", page_size=16, attention_backend="flashinfer-triton")
    one, split = (LLM(model=str(folder), kv_cache_tokens=512, **kwargs).runner for _ in range(2))
    prompt = LONG[1]
    want = one.compute_logits(_extend_batch(prompt, ForwardMode.EXTEND, None, 0, True))
    for i, layers in enumerate([LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4)]):
        got = split.compute_logits(_extend_batch(prompt, ForwardMode.SPLIT_PREFILL, layers, 0, i == 0))
    written = torch.arange(16, 16 + len(prompt), device="cuda")
    for layer in range(NUM_LAYERS):
        torch.testing.assert_close(split.kv_cache.k[layer][written], one.kv_cache.k[layer][written], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(split.kv_cache.v[layer][written], one.kv_cache.v[layer][written], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-2 * float(want.abs().max()))
    turns = LLM(model=str(folder), kv_cache_tokens=4096, max_running_requests=16, **SPLIT, **kwargs)
    llm = LLM(model=str(folder), kv_cache_tokens=4096, max_running_requests=16, enable_split_prefill_overlap=True,
              **SPLIT, **kwargs)
    outputs = mixed_workload(llm, SHORT, LONG)
    assert [len(o) for o in outputs] == [SHORT_TOKENS] * len(SHORT) + [NEW_TOKENS] * len(LONG)
    # the same steps and kernels: the slices beside the decodes on their own stream change no token
    assert outputs == mixed_workload(turns, SHORT, LONG)
    assert llm.stats()["mode_distribution"]["SPLIT_PREFILL"] == NUM_LAYERS * len(LONG)
    assert llm.runner.graphs is not None and llm.runner.graphs.hits["DECODE"] > 0
    assert llm.runner.split.held_slots == () and _idle(llm)


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_two_splits_in_a_row_keep_the_decode_steps_between_slices(decode_steps: int) -> None:
    """Two long prompts arriving together while a request decodes: the first slice at once, then every
    slice, the last of the first split and the first of the second included, after
    ``split_prefill_decode_steps`` decode steps."""
    from modeserve.engine.config import SchedulerConfig
    from modeserve.engine.forward_batch import ForwardResult
    from modeserve.engine.scheduler.create import create_scheduler

    s = create_scheduler(SchedulerConfig(**SPLIT, split_prefill_decode_steps=decode_steps), num_pages=256,
                         page_size=4, max_context=256, vocab_size=384, eos_token_ids=(2,), num_layers=NUM_LAYERS)

    def run() -> ForwardMode:
        step = s.schedule()
        assert step is not None
        s.process_result(step, ForwardResult(np.full(step.batch.num_samples, 7, dtype=np.int64)))
        return step.batch.forward_mode

    s.add_request(s.make_request("d", SHORT[0], SHORT_GREEDY))
    run()
    for i, p in enumerate(LONG[:2]):
        s.add_request(s.make_request(f"long{i}", p, GREEDY))
    modes = [run() for _ in range(2 * NUM_LAYERS * (decode_steps + 1))]
    splits = [i for i, m in enumerate(modes) if m == ForwardMode.SPLIT_PREFILL]
    assert len(splits) == 2 * NUM_LAYERS and splits[0] == 0
    assert {b - a for a, b in zip(splits, splits[1:])} == {decode_steps + 1}
    assert {m for m in modes if m != ForwardMode.SPLIT_PREFILL} == {ForwardMode.DECODE}


def test_split_prefill_settings_out_of_range_are_refused() -> None:
    from modeserve.engine.config import RunnerConfig, SchedulerConfig

    with pytest.raises(ValueError, match="split_prefill_decode_steps must be >= 1"):
        SchedulerConfig(split_prefill_decode_steps=0)
    with pytest.raises(ValueError, match="split_prefill_overlap_sms must be >= 0"):
        RunnerConfig(enable_split_prefill_overlap=True, split_prefill_overlap_sms=-1)
    with pytest.raises(ValueError, match="turn it on"):
        RunnerConfig(split_prefill_overlap_sms=64)
    with pytest.raises(ValueError, match="split_prefill_confine_decodes keeps the decode steps"):
        RunnerConfig(enable_split_prefill_overlap=True, split_prefill_confine_decodes=True)
    with pytest.raises(ValueError, match="small_batch_gemm must be 'cublas' or 'triton'"):
        RunnerConfig(small_batch_gemm="cutlass")
