"""Client-side apply: the merge patch ``Kube.apply`` sends, applied by RFC 7386's own procedure, leaves
the live object with the new build, without what only the old build had, and with what others added."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from modeserve.operator.apply import LAST_APPLIED, annotated, last_applied, removals, still_present, with_removals
from modeserve.operator.kube import Kube


def rfc7386_merge(target: Any, patch: Any) -> Any:
    """MergePatch(Target, Patch) as RFC 7386 section 2 writes it."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = rfc7386_merge(out.get(name), value)
    return out


def build(node_selector: dict[str, str] | None, limits: dict[str, str] | None) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [{"name": "engine", "resources": {"limits": limits} if limits else {}}]}
    if node_selector:
        pod["nodeSelector"] = node_selector
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "llama-engine", "namespace": "serving", "labels": {"app": "llama"}},
            "spec": {"replicas": 2, "template": {"spec": pod}}}


def server_view(obj: dict[str, Any]) -> dict[str, Any]:
    """What a server holds after storing ``obj``: plus defaults and another controller's label."""
    live = copy.deepcopy(obj)
    live["metadata"].update(uid="u1", resourceVersion="7")
    live["metadata"]["labels"]["team"] = "ml"  # added by someone else
    live["spec"]["revisionHistoryLimit"] = 10  # a default
    return live


def test_patch_removes_what_only_the_old_build_had_and_keeps_the_rest() -> None:
    old = build({"gpu": "h200", "zone": "a"}, {"nvidia.com/gpu": "1"})
    new = build({"gpu": "h200"}, None)
    live = server_view(annotated(old))
    nulls = removals(last_applied(live), new)
    assert nulls == {"spec": {"template": {"spec": {"nodeSelector": {"zone": None}}}}}  # lists are replaced whole
    after = rfc7386_merge(live, with_removals(annotated(new), nulls))
    assert after["spec"]["template"]["spec"] == new["spec"]["template"]["spec"]
    assert after["metadata"]["labels"] == {"app": "llama", "team": "ml"} and after["spec"]["revisionHistoryLimit"] == 10
    assert last_applied(after) == new
    assert not still_present(after, removals(last_applied(live), new))


def test_a_whole_mapping_dropped_is_nulled_and_the_patch_is_not_modified_in_place() -> None:
    old, new = build({"gpu": "h200"}, None), build(None, None)
    desired = annotated(new)
    snapshot = copy.deepcopy(desired)
    nulls = removals(old, new)
    patch = with_removals(desired, nulls)
    assert desired == snapshot
    assert patch["spec"]["template"]["spec"]["nodeSelector"] is None
    live = server_view(annotated(old))
    assert still_present(live, nulls)
    assert "nodeSelector" not in rfc7386_merge(live, patch)["spec"]["template"]["spec"]


@pytest.mark.parametrize("raw", [None, "", "not json", "[1, 2]"])
def test_a_live_object_without_a_readable_record_removes_nothing(raw: str | None) -> None:
    live = server_view(build({"gpu": "h200"}, None))
    if raw is not None:
        live["metadata"]["annotations"] = {LAST_APPLIED: raw}
    assert last_applied(live) == {} and removals(last_applied(live), build(None, None)) == {}


class RecordingKube(Kube):
    """``Kube`` over an in-memory store that applies merge patches by RFC 7386; records each write."""

    def __init__(self) -> None:
        self.store: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, Any]] = []

    def request(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
                content_type: str = "application/json") -> dict[str, Any]:
        key = path if method != "POST" else f"{path}/{body['metadata']['name']}"
        if method == "GET":
            if key not in self.store:
                raise ApiException(status=404)
            return copy.deepcopy(self.store[key])
        self.writes.append((method, json.loads(json.dumps(body))))
        self.store[key] = server_view(body) if method == "POST" else rfc7386_merge(self.store[key], body)
        return copy.deepcopy(self.store[key])


def test_kube_apply_creates_patches_removals_and_leaves_an_unchanged_object_alone() -> None:
    kube = RecordingKube()
    first = build({"gpu": "h200"}, {"nvidia.com/gpu": "1"})
    assert kube.apply(first)[1] == "created"
    assert kube.apply(first)[1] == "unchanged" and len(kube.writes) == 1
    second = build(None, None)  # contains() alone would call this unchanged: the live object has more
    live, action = kube.apply(second)
    assert action == "patched"
    pod = live["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and pod["containers"][0]["resources"] == {}
    assert live["metadata"]["labels"]["team"] == "ml"
    assert kube.apply(second)[1] == "unchanged" and len(kube.writes) == 2


def test_kube_apply_records_the_build_once_on_an_object_made_before_the_annotation() -> None:
    kube = RecordingKube()
    obj = build({"gpu": "h200"}, None)
    path = "/apis/apps/v1/namespaces/serving/statefulsets/llama-engine"
    kube.store[path] = server_view(obj)  # no LAST_APPLIED: created by an earlier operator
    assert kube.apply(obj)[1] == "patched"
    assert last_applied(kube.store[path]) == obj
    assert kube.apply(obj)[1] == "unchanged"
