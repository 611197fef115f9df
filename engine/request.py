"""``Req``: one request's state as the scheduler sees it (tokens, KV slots, progress)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

from .sampling_params import SamplingParams


PLACEHOLDER = -1  # an output token sampled by a step still in flight (the engine resolves it)

# why a request finished: a stop token or string, its token or context limit, or an abort
FinishReason = Literal["stop", "length", "abort"]


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """Invariants: ``kv_locs[i]`` is the KV slot of ``fill_ids[i]``; the first ``num_cached`` of them
    belong to the prefix cache (locked through ``cache_node``), the rest to this request.
    The request is *decoding* once ``prefill_done``: then exactly one token (its last) lacks KV."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    kv_locs: list[int] = field(default_factory=list)
    num_cached: int = 0
    cache_node: Any = None
    req_pool_idx: int = -1
    prefill_done: bool = False
    finish_reason: FinishReason | None = None
    matched_stop: str | None = None
    num_retractions: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit on first admission
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # block diffusion: the block being denoised (``scheduler.dllm.Block``), and how many leading tokens'
    # KV is final (their blocks' last forward has been sent)
    block: Any = None
    kv_final: int = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building the whole list."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_known(self) -> int:
        """Leading tokens whose ids are known (placeholders of in-flight steps sit at the end)."""
        n = self.fill_len
        while n > len(self.prompt_ids) and self.output_ids[n - len(self.prompt_ids) - 1] == PLACEHOLDER:
            n -= 1
        return n

    @property
    def num_computed(self) -> int:
        return len(self.kv_locs)

    @property
    def finished(self) -> bool:
        return self.status == ReqStatus.FINISHED
