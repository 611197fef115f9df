"""``LockstepGroup``: DP ranks that must step together (their engines share collectives).

Before every step each member offers what it will run; when all current members have offered, each
gets the same agreement: whether anyone has work (if not, nobody runs a forward) and how to pad a
CUDA-graph step (every rank replays the same bucket, the max over ranks; if any rank runs eagerly,
all do). Membership may change between steps (a rank joins, drains away or fails).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class StepOffer:
    has_work: bool
    graph_rows: int  # rows this rank would replay in a graph, or -1 if its step runs eagerly


@dataclass(frozen=True)
class StepAgreement:
    any_work: bool
    padded_batch_size: int  # > 0: every rank pads its graph step to at least this; -1: all eager


class LockstepGroup:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._members: set[str] = set()
        self._offers: dict[str, StepOffer] = {}
        self._waiting: dict[str, int] = {}  # member -> the round it offered in and has not collected
        self._round = 0
        self._agreements: dict[int, StepAgreement] = {}

    def join(self, member: str) -> None:
        with self._cond:
            self._members.add(member)

    def leave(self, member: str) -> None:
        with self._cond:
            self._members.discard(member)
            self._offers.pop(member, None)
            self._waiting.pop(member, None)
            self._maybe_agree()

    def exchange(self, member: str, offer: StepOffer, timeout: float = 0.1) -> StepAgreement | None:
        """Offer this step and wait for every member's; None if the round is still open after
        ``timeout`` (the caller checks whether it should stop, then calls again: the first offer
        stands, and the round's agreement is collected then)."""
        with self._cond:
            if member not in self._members:
                raise RuntimeError(f"{member} is not in the lockstep group")
            round_no = self._waiting.get(member)
            if round_no is None:
                round_no = self._round
                self._offers[member] = offer
                self._waiting[member] = round_no
                self._maybe_agree()
            if not self._cond.wait_for(lambda: self._round > round_no, timeout=timeout):
                return None
            del self._waiting[member]
            return self._agreements[round_no]

    def _maybe_agree(self) -> None:
        if not self._members or not self._members <= self._offers.keys():
            return
        offers = [self._offers[m] for m in self._members]
        rows = [o.graph_rows for o in offers if o.has_work]
        eager = any(r < 0 for r in rows)
        padded = -1 if eager else max(rows, default=0)
        self._agreements[self._round] = StepAgreement(any(o.has_work for o in offers), padded)
        self._agreements.pop(self._round - 16, None)  # a member collects its round long before this
        self._offers.clear()
        self._round += 1
        self._cond.notify_all()
