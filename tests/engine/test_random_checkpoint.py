"""Random checkpoints of named shapes load in transformers and in modeserve, and agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from modeserve.engine import LLM, SamplingParams
from modeserve.engine.models.random_checkpoint import PRESETS, write_random_checkpoint
from tests.engine.tiny_models import reference_greedy


def test_tiny_preset_matches_transformers(tmp_path: Path) -> None:
    folder = write_random_checkpoint(tmp_path, "tiny", seed=3)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = LLM(model=str(folder)).generate(prompt_token_ids=[[5, 6, 7, 8]],
                                          sampling_params=SamplingParams(temperature=0.0, max_new_tokens=6,
                                                                         ignore_eos=True))
    assert out[0].token_ids == reference_greedy(ref, [5, 6, 7, 8], 6)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_transformers_configs(name: str) -> None:
    fields = dict(PRESETS[name])
    cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    assert cfg.hidden_size == PRESETS[name]["hidden_size"]


def test_unknown_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model shape"):
        write_random_checkpoint(tmp_path, "gpt-9")
