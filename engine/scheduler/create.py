"""``create_scheduler``: the scheduler a model and its configuration call for."""

from __future__ import annotations

from typing import Callable

from ..config import SchedulerConfig
from ..models.dllm_spec import DllmSpec
from .dllm_scheduler import DllmScheduler
from .scheduler import Scheduler
from .speculative_scheduler import SpeculativeScheduler


def create_scheduler(cfg: SchedulerConfig, num_pages: int, page_size: int, max_context: int, vocab_size: int,
                     eos_token_ids: tuple[int, ...], decode: Callable[[list[int]], str] | None = None,
                     num_layers: int = 0, dllm_spec: DllmSpec | None = None) -> Scheduler:
    """A block-diffusion model's (``dllm_spec``) runs DLLM_EXTEND steps only; with ``speculative_algorithm``
    the running requests verify drafts; else the plain scheduler. ``num_layers``: the model's decoder layers
    (split prefill slices them)."""
    if dllm_spec is not None:
        return DllmScheduler(cfg, num_pages, page_size, max_context, vocab_size, eos_token_ids, dllm_spec, decode)
    if cfg.speculative_algorithm:
        return SpeculativeScheduler(cfg, num_pages, page_size, max_context, vocab_size, eos_token_ids, decode,
                                    num_layers)
    return Scheduler(cfg, num_pages, page_size, max_context, vocab_size, eos_token_ids, decode, num_layers)
