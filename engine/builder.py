"""Build the device side of an engine from a model path and flat engine arguments: the one recipe
shared by ``LLM`` and the ``modeserve engine`` server."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple

from .config import EngineConfig
from .default_model import default_model_path
from .models.loader import Checkpoint, open_checkpoint
from .runner.model_runner import ModelRunner
from .tokenizer import Tokenizer, load_tokenizer


class EngineParts(NamedTuple):
    path: Path
    config: EngineConfig
    checkpoint: Checkpoint
    tokenizer: Tokenizer | None
    runner: ModelRunner
    eos_token_ids: tuple[int, ...]  # the tokenizer's end-of-turn ids, then the config's


def build_engine(model: str | Path | None, progress: Callable[[str], None] | None = None,
                 **kwargs: Any) -> EngineParts:
    """``model`` None means the embedded default model. ``ValueError`` on bad paths or arguments."""
    path = Path(model) if model is not None else default_model_path()
    config = EngineConfig.from_kwargs(model=str(path), **kwargs)
    ckpt = open_checkpoint(path, config.runner.load_format)
    tokenizer = load_tokenizer(path)
    eos = tokenizer.eos_token_ids if tokenizer is not None else ()
    runner = ModelRunner(config.runner, ckpt, progress)
    return EngineParts(path, config, ckpt, tokenizer, runner, tuple(dict.fromkeys(eos + ckpt.config.eos_token_ids)))
