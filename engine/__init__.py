"""modeserve.engine: the LLM API, configuration, forward modes and the ForwardBatch contract."""

from .config import EngineConfig, RunnerConfig, SchedulerConfig
from .forward_batch import ForwardBatch, ForwardResult
from .forward_mode import ForwardMode, determine_forward_mode
from .sampling_params import SamplingParams


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
