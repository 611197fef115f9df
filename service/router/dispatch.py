"""Which DP rank a new request goes to: the one whose prefix cache holds the longest prefix of its
prompt, unless that rank is overloaded; else the least loaded; or plain round robin. It reads what
each rank publishes (its snapshot, its prefix index), never a scheduler."""

from __future__ import annotations

import itertools
from typing import Sequence

from .rank_loop import RankLoop

POLICIES = ("prefix", "least-loaded", "round-robin")


class Dispatcher:
    """``balance_abs``/``balance_rel``: the prefix rank is skipped when its load (queued + running
    tokens) exceeds ``balance_rel`` x the lightest rank's load + ``balance_abs``."""

    def __init__(self, policy: str = "prefix", balance_abs: int = 4096, balance_rel: float = 1.5) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown dispatch policy {policy!r}; choose one of {POLICIES}")
        self.policy = policy
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._rr = itertools.count()

    def choose(self, loops: Sequence[RankLoop], prompt_ids: Sequence[int]) -> RankLoop:
        if not loops:
            raise LookupError("no engine rank is ready")
        if self.policy == "round-robin":
            return loops[next(self._rr) % len(loops)]
        # rotate the start so equal loads spread instead of piling onto the first rank
        start = next(self._rr) % len(loops)
        order = list(loops[start:]) + list(loops[:start])
        loads = {id(lp): (lp.load_tokens, lp.num_requests) for lp in order}
        lightest = min(order, key=lambda lp: loads[id(lp)])
        if self.policy == "least-loaded":
            return lightest
        hits = {id(lp): lp.prefix.match_len(prompt_ids) for lp in order}
        best = max(order, key=lambda lp: (hits[id(lp)], [-x for x in loads[id(lp)]]))
        if hits[id(best)] == 0:
            return lightest
        if loads[id(best)][0] > self.balance_rel * loads[id(lightest)][0] + self.balance_abs:
            return lightest
        return best
