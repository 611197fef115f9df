"""The model runner of an engine's config: the recipe every tensor-parallel rank follows (rank 0 in
``engine.builder``, the others in ``engine.distributed.worker``, which need no tokenizer)."""

from __future__ import annotations

from typing import Callable

from ..config import EngineConfig
from ..distributed.group import TpGroup
from ..models.dllm_spec import resolve_dllm
from ..models.loader import Checkpoint
from .model_runner import ModelRunner


def build_runner(config: EngineConfig, ckpt: Checkpoint, progress: Callable[[str], None] | None = None,
                 tp: TpGroup | None = None, draft: Checkpoint | None = None) -> ModelRunner:
    """The model runner of ``config`` (one rank's, given ``tp``): the recipe every rank follows."""
    sched = config.scheduler
    dllm = resolve_dllm(ckpt.config, config.runner.dllm_block_size, config.runner.dllm_mask_token_id)
    return ModelRunner(config.runner, ckpt, progress, draft,
                       sched.speculative_num_steps + 1 if sched.speculative_algorithm else 0,
                       (sched.speculative_ngram_min, sched.speculative_ngram_max), dllm, tp)
