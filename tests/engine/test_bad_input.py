"""Bad input gives a clear ValueError at the call, never a hang or crash, and loses nothing else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from modeserve.engine import LLM, ForwardMode, SamplingParams
from modeserve.engine.forward_batch import ForwardBatch

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(model=str(tiny_llama), device="cpu", dtype="float32", max_context_len=64, kv_cache_tokens=512)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], "prompt is empty"),
        (list(range(3, 3 + 64)), "context holds 64"),
        ([5, 384, 7], "outside the vocabulary"),
        ([5, -1, 7], "outside the vocabulary"),
    ],
)
def test_bad_prompts(llm: LLM, prompt: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt_token_ids=[[3, 4, 5], prompt], sampling_params=GREEDY)
    assert not llm.scheduler.has_work  # nothing of the batch was queued


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=2.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_bad_sampling_params(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_text_prompt_without_tokenizer_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(prompts=["hello"], sampling_params=GREEDY)


def test_request_too_big_for_kv_pool(tiny_llama: Path) -> None:
    small = LLM(model=str(tiny_llama), kv_cache_tokens=32, page_size=16)
    with pytest.raises(ValueError, match="KV pool"):
        small.generate(prompt_token_ids=[[3] * 20], sampling_params=GREEDY.replace(max_new_tokens=40))


@pytest.mark.parametrize("path, match", [("/nonexistent/model", "does not exist"), ("README", "not a .gguf")])
def test_unknown_model_path(tmp_path: Path, path: str, match: str) -> None:
    if path == "README":
        (tmp_path / "README").write_text("not a model")
        path = str(tmp_path / "README")
    with pytest.raises(ValueError, match=match):
        LLM(model=path)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(tmp_path))


def test_unknown_engine_argument(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="unknown engine arguments"):
        LLM(model=str(tiny_llama), chunk_size=4)


@pytest.mark.parametrize("mode", [m for m in ForwardMode if not m.traits.supported])
def test_modes_not_landed_are_refused(llm: LLM, mode: ForwardMode) -> None:
    empty = np.zeros(0, dtype=np.int64)
    batch = ForwardBatch(mode, empty, empty, empty, np.zeros(0, dtype=bool), empty, empty, empty)
    with pytest.raises(ValueError, match=f"{mode.name} is not implemented"):
        llm.runner.forward(batch)


def test_bad_request_loses_nothing_in_flight(llm: LLM) -> None:
    good = llm.make_request([3, 4, 5, 6], GREEDY.replace(max_new_tokens=6))
    llm.add_request(good)
    llm.step()
    with pytest.raises(ValueError):
        llm.make_request([3, 10_000], GREEDY)
    while not good.finished:
        llm.step()
    assert good.finish_reason == "length" and len(good.output_ids) == 6
    again = llm.generate(prompt_token_ids=[[3, 4, 5, 6]], sampling_params=GREEDY.replace(max_new_tokens=6))
    assert again[0].token_ids == good.output_ids


def test_idle_batch_runs_on_the_engine(llm: LLM) -> None:
    result = llm.runner.forward(ForwardBatch.idle())
    assert result.next_token_ids.shape == (0,)
