"""Stop conditions checked after each sampled token."""

from __future__ import annotations

from typing import Callable

from ..request import FinishReason, Req


class StopChecker:
    """Decides whether a request is done; ``decode`` (token ids -> text) enables stop strings."""

    def __init__(self, eos_token_ids: tuple[int, ...], max_context: int,
                 decode: Callable[[list[int]], str] | None) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.decode = decode

    def check(self, req: Req, num_outputs: int) -> FinishReason | None:
        """``"stop"`` or ``"length"`` when ``req`` must finish after output token ``num_outputs - 1``
        (later entries of ``output_ids`` may be placeholders of steps still in flight)."""
        sp, last = req.sampling, req.output_ids[num_outputs - 1]
        if last in sp.stop_token_ids or (not sp.ignore_eos and last in self.eos_token_ids):
            return "stop"
        if sp.stop and self.decode is not None:
            window = max(len(s) for s in sp.stop) + 8
            tail = self.decode(req.output_ids[max(0, num_outputs - window) : num_outputs])
            for s in sp.stop:
                if s in tail:
                    req.matched_stop = s
                    return "stop"
        if num_outputs >= sp.max_new_tokens or len(req.prompt_ids) + num_outputs >= self.max_context:
            return "length"
        return None
