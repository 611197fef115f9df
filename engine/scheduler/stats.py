"""Per-forward-mode statistics (the seed's ``ForwardModeStats``, with batch sizes and time)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from modeserve.engine.forward_mode import ForwardMode


class ForwardModeStats:
    def __init__(self) -> None:
        self.mode_counts: dict[str, int] = defaultdict(int)
        self.mode_tokens: dict[str, int] = defaultdict(int)
        self.mode_requests: dict[str, int] = defaultdict(int)
        self.mode_seconds: dict[str, float] = defaultdict(float)
        self.num_retractions = 0
        self.num_prefix_hit_tokens = 0

    def record(self, mode: ForwardMode, batch_size: int, num_tokens: int, seconds: float = 0.0) -> None:
        self.mode_counts[mode.name] += 1
        self.mode_tokens[mode.name] += num_tokens
        self.mode_requests[mode.name] += batch_size
        self.mode_seconds[mode.name] += seconds

    def add_time(self, mode: ForwardMode, seconds: float) -> None:
        self.mode_seconds[mode.name] += seconds

    def get_stats(self) -> dict[str, Any]:
        return {
            "mode_distribution": dict(self.mode_counts),
            "tokens_by_mode": dict(self.mode_tokens),
            "requests_by_mode": dict(self.mode_requests),
            "seconds_by_mode": {k: round(v, 6) for k, v in self.mode_seconds.items()},
            "num_retractions": self.num_retractions,
            "num_prefix_hit_tokens": self.num_prefix_hit_tokens,
        }
