"""An EngineSet's conditions (pure): Available, Progressing, Degraded, each with a reason and a message
a person can act on.

- Available: the router is reachable and at least one rank is Ready.
- Progressing: ranks are joining, draining, or the StatefulSet is not at the wanted size yet.
- Degraded: the spec is invalid, the router is unreachable, or ranks are NotReady.

``lastTransitionTime`` changes only when a condition's status does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .ranks import ScalePlan

Obj = dict[str, Any]
TYPES = ("Available", "Progressing", "Degraded")


def _condition(type_: str, ok: bool, reason: str, message: str) -> Obj:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def merge_conditions(previous: Sequence[Mapping[str, Any]], new: Sequence[Obj], timestamp: str) -> list[Obj]:
    """``new`` replaces the conditions of the same type; the others are kept. A condition keeps its
    ``lastTransitionTime`` while its status stays the same."""
    before = {c.get("type"): c for c in previous}
    replaced = {c["type"]: c for c in new}
    out = []
    for type_ in [*TYPES, *(t for t in before if t not in TYPES)]:
        if type_ in replaced:
            cond = dict(replaced[type_])
            old = before.get(type_)
            same = old is not None and old.get("status") == cond["status"] and old.get("lastTransitionTime")
            cond["lastTransitionTime"] = old["lastTransitionTime"] if same and old else timestamp
            out.append(cond)
        elif type_ in before:
            out.append(dict(before[type_]))
    return out


def _ranks(table: Sequence[Mapping[str, Any]], state: str) -> list[int]:
    return [int(r["rank"]) for r in table if r.get("state") == state]


def conditions(table: Sequence[Mapping[str, Any]], desired: int, plan: ScalePlan, router_error: str | None,
               previous: Sequence[Mapping[str, Any]], timestamp: str) -> list[Obj]:
    """The three conditions from the rank table (``status.ranks``), the scale plan and whether the
    router answered (``router_error`` is None when it did)."""
    ready = _ranks(table, "Ready")
    joining = _ranks(table, "Joining")
    not_ready = _ranks(table, "NotReady")
    summary = f"{len(ready)} of {desired} ranks ready"

    if router_error is not None:
        available = _condition("Available", False, "RouterUnreachable", f"router unreachable: {router_error}")
    elif desired == 0:
        available = _condition("Available", False, "ScaledToZero", "spec.replicas is 0")
    elif ready:
        available = _condition("Available", True, "RanksReady", summary)
    else:
        available = _condition("Available", False, "NoRankReady", summary)

    if plan.waiting:
        left = "" if plan.seconds_left is None else f" (removed anyway in {max(plan.seconds_left, 0.0):.0f}s)"
        progressing = _condition("Progressing", True, "Draining",
                                 f"ranks {sorted(plan.waiting)} draining before the scale-down to {desired}{left}")
    elif plan.statefulset_replicas != desired:
        progressing = _condition("Progressing", True, "ScalingDown", f"scaling down to {desired}")
    elif joining:
        progressing = _condition("Progressing", True, "RanksJoining", f"ranks {joining} joining; {summary}")
    else:
        progressing = _condition("Progressing", False, "Stable", summary)

    if router_error is not None:
        degraded = _condition("Degraded", True, "RouterUnreachable", f"router unreachable: {router_error}")
    elif not_ready:
        degraded = _condition("Degraded", True, "RanksNotReady",
                              f"ranks {not_ready} not ready (pod failed, or failing its readiness probe); "
                              "the router does not send them requests")
    elif plan.timed_out:
        degraded = _condition("Degraded", True, "DrainTimedOut",
                              f"ranks {sorted(plan.timed_out)} removed before they drained (drainTimeoutSeconds)")
    else:
        degraded = _condition("Degraded", False, "AsExpected", summary)
    return merge_conditions(previous, [available, progressing, degraded], timestamp)


def invalid_spec_conditions(message: str, previous: Sequence[Mapping[str, Any]], timestamp: str) -> list[Obj]:
    """Degraded with the spec's problems; Available stays what it was (False for a new EngineSet)."""
    new = [_condition("Degraded", True, "InvalidSpec", message),
           _condition("Progressing", False, "InvalidSpec", "waiting for a valid spec")]
    if not any(c.get("type") == "Available" for c in previous):
        new.append(_condition("Available", False, "InvalidSpec", "nothing deployed: the spec is invalid"))
    return merge_conditions(previous, new, timestamp)
