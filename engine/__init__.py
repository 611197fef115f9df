"""modeserve.engine: the LLM API, configuration, forward modes and the ForwardBatch contract."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import EngineConfig, RunnerConfig, SchedulerConfig
from .forward_batch import ForwardBatch, ForwardResult
from .forward_mode import ForwardMode, determine_forward_mode
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .llm import LLM, RequestOutput


def __getattr__(name: str) -> object:
    # LLM pulls in torch and the models; import it lazily so light users (the router) stay light.
    if name in ("LLM", "RequestOutput"):
        from . import llm

        return getattr(llm, name)
    raise AttributeError(name)


__all__ = [
    "LLM", "RequestOutput", "SamplingParams", "EngineConfig", "RunnerConfig", "SchedulerConfig",
    "ForwardBatch", "ForwardResult", "ForwardMode", "determine_forward_mode",
]
