"""What a request may ask of an engine, and the one check of a prompt against it (``LLM`` and the
router's Generate and HTTP edges all call ``check_prompt``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RequestLimits:
    max_context: int  # prompt + generated tokens
    vocab_size: int
    kv_capacity_tokens: int  # KV slots one request may hold at most
    max_new_tokens: int | None  # the most a client of the service may ask for (None: no bound but the context)
    max_prompt_chars: int  # text longer than this is refused before it is tokenized


def check_prompt(prompt_ids: Sequence[int], max_new_tokens: int, limits: RequestLimits) -> None:
    """``ValueError`` naming what is wrong with ``prompt_ids`` + ``max_new_tokens``."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})")
    if len(prompt_ids) >= limits.max_context:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context holds {limits.max_context} "
                         f"(prompt + at least one new token)")
    need = min(len(prompt_ids) + max_new_tokens, limits.max_context)
    if need > limits.kv_capacity_tokens:
        raise ValueError(f"prompt + max_new_tokens needs {need} KV slots, the KV pool has "
                         f"{limits.kv_capacity_tokens}; lower max_new_tokens or raise kv_cache_tokens")
