"""Client-side apply of the objects the operator builds: the JSON merge patch that makes the live object
hold what was built, and drops what an earlier build had and this one has not.

A merge patch (RFC 7386) only removes a key that it sets to null, so every applied object carries the
build it came from in the annotation ``LAST_APPLIED`` (as ``kubectl apply`` keeps its
``last-applied-configuration``); a key of that build which the new one lacks is patched to null. Keys
that others add (the API server's defaults, another controller's labels) were never in a build and
stay. Lists are replaced as a whole by a merge patch, so removals are looked for in mappings only.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]
LAST_APPLIED = "modeserve.io/last-applied"


def merge_patch(live: Mapping[str, Any], built: Obj) -> Obj | None:
    """The merge patch that makes ``live`` hold ``built`` (annotated) and drops what the last applied
    build had and ``built`` has not; None when there is nothing to change."""
    desired = annotated(built)
    nulls = removals(last_applied(live), built)
    if contains(live, desired) and not still_present(live, nulls):
        return None
    return with_removals(desired, nulls)


def contains(actual: Any, wanted: Any) -> bool:
    """``wanted`` is already part of ``actual`` (dicts: every key recursively; lists: same length,
    item by item), so patching would change nothing. Fields the server adds are ignored."""
    if isinstance(wanted, Mapping):
        return isinstance(actual, Mapping) and all(k in actual and contains(actual[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(actual, list) and len(actual) == len(wanted) and all(
            contains(a, w) for a, w in zip(actual, wanted))
    return bool(actual == wanted)


def annotated(built: Obj) -> Obj:
    """``built`` with its own compact JSON in ``metadata.annotations[LAST_APPLIED]``."""
    out = copy.deepcopy(built)
    meta = out.setdefault("metadata", {})
    meta["annotations"] = {**(meta.get("annotations") or {}), LAST_APPLIED: _compact(built)}
    return out


def last_applied(live: Mapping[str, Any]) -> Obj:
    """The build recorded on a live object; {} if it has none (created before the annotation existed,
    or it was edited into something that is not a JSON object)."""
    raw = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        found = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def removals(before: Mapping[str, Any], after: Mapping[str, Any]) -> Obj:
    """Null for every key of ``before`` that ``after`` lacks, nested where both hold a mapping."""
    out: Obj = {}
    for key, old in before.items():
        if key not in after:
            out[key] = None
        elif isinstance(old, Mapping) and isinstance(after[key], Mapping):
            inner = removals(old, after[key])
            if inner:
                out[key] = inner
    return out


def still_present(live: Mapping[str, Any], nulls: Mapping[str, Any]) -> bool:
    """Whether any key that ``nulls`` removes is on the live object."""
    for key, sub in nulls.items():
        if key not in live:
            continue
        if sub is None or not isinstance(live[key], Mapping) or still_present(live[key], sub):
            return True
    return False


def with_removals(patch: Obj, nulls: Mapping[str, Any]) -> Obj:
    """``patch`` (not changed) plus the nulls of ``removals``."""
    out = dict(patch)
    for key, sub in nulls.items():
        out[key] = None if sub is None else with_removals(out.get(key) or {}, sub)
    return out


def _compact(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
