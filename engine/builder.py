"""Build the device side of an engine from a model path and flat engine arguments: the one recipe
shared by ``LLM`` and the ``modeserve engine`` server."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from .config import EngineConfig
from .default_model import default_model_path
from .distributed.launch import TpWorkers
from .distributed.shard import check_tensor_parallel
from .models.loader import Checkpoint, open_checkpoint
from .runner.build import build_runner
from .runner.model_runner import ModelRunner
from .tokenizer import Tokenizer, load_tokenizer


class EngineParts(NamedTuple):
    path: Path
    config: EngineConfig
    checkpoint: Checkpoint
    tokenizer: Tokenizer | None
    runner: ModelRunner
    eos_token_ids: tuple[int, ...]  # the tokenizer's end-of-turn ids, then the config's
    tp_workers: TpWorkers | None = None  # ranks 1.. of a tensor-parallel engine (this process is rank 0)


def build_engine(model: str | Path | None, progress: Callable[[str], None] | None = None,
                 exit_on_tp_loss: bool = True, **kwargs: Any) -> EngineParts:
    """``model`` None means the embedded default model. ``ValueError`` on bad paths or arguments.
    With ``tensor_parallel_size`` N > 1 this process is rank 0 and starts ranks 1 … N-1 (``exit_on_tp_loss``:
    the death of one ends this process)."""
    path = Path(model) if model is not None else default_model_path()
    config = EngineConfig.from_kwargs(model=str(path), **kwargs)
    ckpt = open_checkpoint(path, config.runner.load_format)
    tokenizer = load_tokenizer(path)
    eos = tokenizer.eos_token_ids if tokenizer is not None else ()
    draft = None
    if config.runner.speculative_draft_model is not None:
        draft = open_checkpoint(config.runner.speculative_draft_model, config.runner.load_format)
        check_draft(ckpt, tokenizer, draft, load_tokenizer(draft.path) if draft.path != ckpt.path else tokenizer)
    size = config.runner.tensor_parallel_size
    workers = None
    if size > 1:
        if ckpt.is_gguf:
            raise ValueError("tensor parallelism loads Hugging Face safetensors folders, not GGUF files")
        check_tensor_parallel(ckpt.config, size)
        if config.runner.device not in ("cpu", "cuda"):
            raise ValueError(f"tensor parallelism places rank r on cuda:r (or the CPU): give device 'cuda' or 'cpu', "
                             f"not {config.runner.device!r}")
        if config.runner.device == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} CUDA devices, this machine has "
                             f"{torch.cuda.device_count()}")
        if draft is not None:
            raise ValueError("speculative_algorithm 'draft' runs with tensor_parallel_size 1 (n-gram drafts do not)")
        device = torch.device(config.runner.device, 0) if config.runner.device == "cuda" else torch.device("cpu")
        workers = TpWorkers(str(path), kwargs, size, device, exit_on_tp_loss)
    try:
        runner = build_runner(config, ckpt, progress, workers.group if workers else None, draft)
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    return EngineParts(path, config, ckpt, tokenizer, runner, tuple(dict.fromkeys(eos + ckpt.config.eos_token_ids)),
                       workers)


def check_draft(target: Checkpoint, tokenizer: Tokenizer | None, draft: Checkpoint, draft_tokenizer: Tokenizer | None) -> None:
    """A draft model proposes the target's token ids: the same vocabulary size, and the same tokens
    where both have a tokenizer (``ValueError`` otherwise)."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_draft_model {str(draft.path)!r} has a vocabulary of {draft.config.vocab_size} "
                         f"ids, the target {target.config.vocab_size}: a draft must share the target's vocabulary")
    if (tokenizer is None) != (draft_tokenizer is None) or (
            tokenizer is not None and draft_tokenizer is not None
            and tokenizer.hf_tokenizer.get_vocab() != draft_tokenizer.hf_tokenizer.get_vocab()):
        raise ValueError(f"speculative_draft_model {str(draft.path)!r} does not share the target's tokenizer")
