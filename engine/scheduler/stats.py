"""Per-forward-mode statistics (the seed's ``ForwardModeStats``, with batch sizes and time)."""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any, Iterable

from ..forward_mode import ForwardMode


# upper bounds (seconds) of the step-time histogram: 0.5 ms .. 10 s
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class ForwardModeStats:
    """The single source of per-mode step counts (the step log line, ``llm.stats()``, the Prometheus
    metrics and the Describe/ModelInfo RPCs all read this)."""

    def __init__(self) -> None:
        self.mode_counts: dict[str, int] = defaultdict(int)
        self.mode_tokens: dict[str, int] = defaultdict(int)
        self.mode_requests: dict[str, int] = defaultdict(int)
        self.mode_seconds: dict[str, float] = defaultdict(float)
        # per mode (the modes with timed steps): counts of steps whose time falls at or under each bucket
        # bound (cumulative at read)
        self.mode_time_buckets: dict[str, list[int]] = defaultdict(lambda: [0] * (len(STEP_SECONDS_BUCKETS) + 1))
        self.num_retractions = 0
        self.num_prefix_hit_tokens = 0
        self.spec_draft_tokens = 0  # drafts proposed to TARGET_VERIFY steps
        self.spec_accepted_tokens = 0  # of those, the ones the target kept
        self.spec_verify_steps = 0
        self.spec_chained_rows = 0  # verify rows built while the request's last verify step ran (overlap)
        self.spec_acceptance_lengths: dict[int, int] = defaultdict(int)  # tokens a verify emitted for a request -> count
        self.dllm_unmasked: dict[int, int] = defaultdict(int)  # tokens a DLLM_EXTEND step unmasked in a block -> count

    def record_acceptance(self, kept: int) -> None:
        """A request of a verify step kept ``kept`` drafts (it emits ``kept + 1`` tokens)."""
        self.spec_accepted_tokens += kept
        self.spec_acceptance_lengths[kept + 1] += 1

    def record_dllm_unmasked(self, n: int) -> None:
        """A DLLM_EXTEND step unmasked ``n`` tokens of a request's block."""
        self.dllm_unmasked[n] += 1

    def acceptance_histogram(self, max_length: int) -> tuple[list[tuple[float, int]], int]:
        """(cumulative (upper bound, count) pairs for lengths 1 .. ``max_length`` and +inf, sum of lengths)."""
        return _cumulative(self.spec_acceptance_lengths, range(1, max_length + 1))

    def dllm_unmasked_histogram(self) -> tuple[list[tuple[float, int]], int]:
        """(cumulative (upper bound, count) pairs at 0, 1, 2, 4 .. 256 and +inf, sum) of the tokens a
        DLLM_EXTEND step unmasked in a request's block."""
        return _cumulative(self.dllm_unmasked, [0, *(2**i for i in range(9))])

    def record(self, mode: ForwardMode, batch_size: int, num_tokens: int, seconds: float = 0.0) -> None:
        self.mode_counts[mode.name] += 1
        self.mode_tokens[mode.name] += num_tokens
        self.mode_requests[mode.name] += batch_size
        if seconds:
            self.add_time(mode, seconds)

    def log_line(self, step: int, mode: ForwardMode, batch_size: int, num_tokens: int) -> str:
        """The per-step log line: this step, then this mode's running totals (as /metrics shows them)."""
        name = mode.name
        return (f"step {step}: mode={name} batch_size={batch_size} num_tokens={num_tokens} "
                f"| {name} steps={self.mode_counts[name]} tokens={self.mode_tokens[name]} "
                f"seconds={self.mode_seconds[name]:.3f}")

    def add_time(self, mode: ForwardMode, seconds: float) -> None:
        """One step of ``mode`` took ``seconds`` (its sum and its histogram bucket)."""
        self.mode_seconds[mode.name] += seconds
        self.mode_time_buckets[mode.name][bisect.bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1

    def step_time_histogram(self, mode: str) -> tuple[list[tuple[float, int]], int, float]:
        """(cumulative (upper bound, count) pairs incl. +inf, step count, seconds sum) of ``mode``."""
        counts = list(self.mode_time_buckets.get(mode, [0] * (len(STEP_SECONDS_BUCKETS) + 1)))
        bounds = [*STEP_SECONDS_BUCKETS, float("inf")]
        cumulative, total = [], 0
        for bound, n in zip(bounds, counts):
            total += n
            cumulative.append((bound, total))
        return cumulative, total, self.mode_seconds.get(mode, 0.0)

    def get_stats(self) -> dict[str, Any]:
        return {
            "mode_distribution": dict(self.mode_counts),
            "tokens_by_mode": dict(self.mode_tokens),
            "requests_by_mode": dict(self.mode_requests),
            "seconds_by_mode": {k: round(v, 6) for k, v in self.mode_seconds.items()},
            "num_retractions": self.num_retractions,
            "num_prefix_hit_tokens": self.num_prefix_hit_tokens,
            "speculative": {"draft_tokens": self.spec_draft_tokens, "accepted_tokens": self.spec_accepted_tokens,
                            "verify_steps": self.spec_verify_steps, "chained_rows": self.spec_chained_rows},
            "dllm_unmasked_per_step": dict(sorted(self.dllm_unmasked.items())),
        }


def _cumulative(counts: dict[int, int], bounds: Iterable[int]) -> tuple[list[tuple[float, int]], int]:
    """Prometheus-style cumulative buckets of ``counts`` (value -> occurrences) at ``bounds`` and +inf, and
    the sum of the values."""
    out = [(float(b), sum(n for v, n in counts.items() if v <= b)) for b in [*bounds, float("inf")]]
    return out, sum(v * n for v, n in counts.items())
